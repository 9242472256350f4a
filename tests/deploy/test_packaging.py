"""Packaging: the license the project declares is the license it ships, and the package is marked typed.

Proves: LICENSE is the Apache License 2.0 text, unchanged apart from its copyright line (pyproject declares
Apache-2.0); shardserve/py.typed exists and pyproject's package data lists it; a wheel built from the tree (no
index: setuptools' build hook, about a second) carries shardserve/py.typed, the LICENSE file and Apache-2.0 in its
metadata.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPYRIGHT = "Copyright 2026 The shardserve authors"
# sha256 of the Apache License 2.0 text as the ASF publishes it (https://www.apache.org/licenses/LICENSE-2.0.txt),
# whose appendix has the placeholder line below.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
PLACEHOLDER = "Copyright [yyyy] [name of copyright owner]"


def license_is_apache_2_0(text: str) -> bool:
    """True when text is the Apache 2.0 text with its appendix's copyright placeholder filled in as ours."""
    if text.count(COPYRIGHT) != 1:
        return False
    canonical = text.replace(COPYRIGHT, PLACEHOLDER)
    return hashlib.sha256(canonical.encode()).hexdigest() == APACHE_2_0_SHA256


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_apache_2_0():
    assert _pyproject()["project"]["license"] == {"text": "Apache-2.0"}


def test_license_file_is_the_apache_2_0_text_with_our_copyright():
    assert license_is_apache_2_0((ROOT / "LICENSE").read_text())


def test_license_check_refuses_altered_text():
    text = (ROOT / "LICENSE").read_text()
    assert not license_is_apache_2_0(text.replace("Version 2.0, January 2004", "Version 2.1, January 2004"))
    assert not license_is_apache_2_0(text.replace(COPYRIGHT, "Copyright 2026 Someone else"))
    assert not license_is_apache_2_0(text + "\nAn extra clause.\n")


def test_py_typed_exists_and_is_package_data():
    assert (ROOT / "shardserve" / "py.typed").is_file()
    assert (ROOT / "shardserve" / "py.typed").read_text() == ""
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["shardserve"]


def _build_wheel(tmp_path: Path) -> Path:
    """Builds the wheel from a copy of the tree (setuptools writes build/ and *.egg-info next to the sources) by
    calling setuptools' PEP 517 hook, as `pip wheel --no-build-isolation` does, without pip's start-up."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: no wheel can be built without an index")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".whl", "gpu-out"))
    out = tmp_path / "dist"
    out.mkdir()
    hook = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    result = subprocess.run([sys.executable, "-c", hook], cwd=source, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("shardserve-*.whl")
    return wheel


def test_built_wheel_carries_py_typed_license_and_metadata(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "shardserve/py.typed" in names
        licenses = [n for n in names if n.split("/")[0].endswith(".dist-info") and n.endswith("/LICENSE")]
        assert len(licenses) == 1, names
        assert license_is_apache_2_0(archive.read(licenses[0]).decode())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(archive.read(metadata).decode(), headersonly=True)
    assert "Apache-2.0" in (fields.get("License-Expression"), fields.get("License"))
