"""The repository's folders do not hide installed packages of the same name.

The folders map to `shardserve.<name>`, but a process whose sys.path holds the repository's root (pytest here,
`python -m shardserve.demo` in a checkout) can also import `kernels/` as a top-level `kernels`, the name of the
Hugging Face package that transformers (>= 5.25) imports at load. Proves, in fresh interpreters started in the
repository's root: `import kernels` gives another package called `kernels` where one is installed (a stand-in in a
temporary folder after the root on sys.path, before site-packages), and our empty module where none is;
`shardserve.kernels` stays ours either way; with transformers' own `kernels` installed, transformers' hub-kernels
module imports and the default model's transformers class builds from the root; no installed distribution ships a
top-level package named like another of our folders.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_in_root(code: str, extra_path: str | None = None) -> str:
    """Runs code with `python -c` in the repository's root (which puts the root first on sys.path), extra_path
    second (before site-packages)."""
    prefix = f"import sys; sys.path.insert(1, {extra_path!r})\n" if extra_path else ""
    done = subprocess.run(
        [sys.executable, "-c", prefix + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_top_level_kernels_installed_elsewhere_wins_over_the_folder(tmp_path):
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("MARK = 'the installed one'\nfrom kernels.part import PART\n")
    (other / "part.py").write_text("PART = 7\n")
    out = _run_in_root(
        "import kernels, shardserve.kernels.cpu_native as ours\n"
        "print(kernels.MARK, kernels.PART, kernels.__file__, ours.__file__, sep='|')",
        extra_path=str(tmp_path),
    )
    mark, part, theirs_file, ours_file = out.split("|")
    assert (mark, part) == ("the installed one", "7")
    assert Path(theirs_file) == other / "__init__.py"
    assert Path(ours_file) == ROOT / "kernels" / "cpu_native.py"


def test_without_another_kernels_the_name_stays_on_the_folder(tmp_path):
    # sys.path without site-packages' own `kernels`: only the root's folder answers to the name.
    code = (
        "import sys, os\n"
        "sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or '.', 'kernels'))"
        " or os.path.abspath(p or '.') == os.getcwd()]\n"
        "import kernels\n"
        "print(kernels.__file__, [n for n in vars(kernels) if not n.startswith('_')], sep='|')"
    )
    where, names = _run_in_root(code).split("|")
    assert Path(where) == ROOT / "kernels" / "__init__.py"
    assert names == "[]"


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_distribution("kernels"), reason="transformers' kernels package is not installed")
def test_transformers_hub_kernels_import_from_the_repository_root():
    out = _run_in_root(
        "import kernels\n"
        "import transformers.integrations.hub_kernels as hub\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "from shardserve.settings.model_source import default_model_dir\n"
        "model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model_dir()))\n"
        "print(kernels.__file__, hub.__name__, model.config.model_type, sep='|')"
    )
    where, _, model_type = out.split("|")
    assert not Path(where).is_relative_to(ROOT / "kernels")
    assert model_type == "llama"


def test_no_installed_distribution_ships_another_of_our_folders_names():
    # kernels/ steps aside for Hugging Face's `kernels` (above); the other folders do not know how to, so a
    # dependency that brings e.g. a top-level `proto` (proto-plus does) must fail here, not in a model load.
    ours = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert {"cluster", "kernels", "proto", "worker"} <= set(ours)
    shipped = importlib.metadata.packages_distributions()
    clashes = {name: shipped[name] for name in ours if name in shipped and name not in ("kernels", "shardserve")}
    assert clashes == {}
