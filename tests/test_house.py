"""The house's shape, checked on the source tree (no imports, ~0.1 s): files of a size a reader holds, one job per
module name, a face whose top level holds only its entry points, and docs/architecture.md's "Who owns what" tables
naming files that exist. Each check is a function of the tree, so the planted-breach tests below run it on a
small tree of their own."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")  # protoc's stubs (proto/generate.sh)
# Files still over MAX_LINES, each with what is to become of it; an entry that fits again fails the test, so it goes.
AWAITING_SPLIT = {
    "cluster/scheduler.py": "the running requests' pass, the waiting queue's admission and the plan's assembly, apart",
    "cluster/front.py": "the client API's request side: live requests and streams apart from admission and routing",
}
# Module names that deliberately serve more than one module: the name, and why.
SHARED_NAMES = {
    "__init__": "every package has one",
    "__main__": "`python -m shardserve` and `python -m shardserve.cli` are both entry points",
}
FACE_TOP = {"__init__.py", "__main__.py", "demo.py"}  # the face's top level: the package's public entry points


def python_files(root: Path) -> list[Path]:
    """Every Python file of the package's folders (pyproject.toml's package-dir), tests and stubs left out."""
    with open(root / "pyproject.toml", "rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for folder in set(folders) for p in (root / folder).glob("*.py") if not GENERATED.search(p.name))


def too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Files over limit lines -> their length (paths relative to root)."""
    out = {}
    for path in python_files(root):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out[path.relative_to(root).as_posix()] = lines
    return out


def names_used_twice(root: Path) -> dict[str, list[str]]:
    """Module (and package) names that more than one file or folder of the package has, -> where."""
    with open(root / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    seen: dict[str, list[str]] = {}
    for package, folder in packages.items():
        seen.setdefault(package.rpartition(".")[2], []).append(folder + "/")
    for path in python_files(root):
        seen.setdefault(path.stem, []).append(path.relative_to(root).as_posix())
    return {name: sorted(where) for name, where in seen.items() if len(where) > 1 and name not in SHARED_NAMES}


def owned_files(architecture: str) -> list[tuple[str, str]]:
    """(folder of its table, name) for every name in the first column of the "Who owns what" tables."""
    section = architecture.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    out, folder = [], ""
    for line in section.splitlines():
        if line.startswith("**"):
            folder = line.split("**")[1]
        elif line.startswith("| `"):
            out += [(folder, name) for name in re.findall(r"`([^`]+)`", line.split("|")[1])]
    return out


def missing_owned(root: Path) -> list[str]:
    """Names of the tables that no file or folder has: looked up in the table's folder, then at the root (globs
    allowed)."""
    missing = []
    for folder, name in owned_files((root / "docs" / "architecture.md").read_text()):
        if not any(next(base.glob(name.rstrip("/")), None) for base in (root / folder, root)):
            missing.append(f"{folder}{name}")
    return missing


# ---- the tree ------------------------------------------------------------------------------------------------
def test_no_python_file_outside_tests_and_stubs_is_over_300_lines():
    over = too_long(ROOT)
    assert set(over) <= set(AWAITING_SPLIT), {p: n for p, n in over.items() if p not in AWAITING_SPLIT}
    fits = sorted(set(AWAITING_SPLIT) - set(over))
    assert not fits, f"{fits} fit in {MAX_LINES} lines now: take them off AWAITING_SPLIT"


def test_no_module_name_serves_two_jobs():
    assert names_used_twice(ROOT) == {}


def test_the_faces_top_level_holds_only_its_entry_points():
    assert {p.name for p in (ROOT / "shardserve").glob("*.py")} <= FACE_TOP


def test_every_file_the_architecture_tables_name_exists():
    assert len(owned_files((ROOT / "docs" / "architecture.md").read_text())) > 50  # (the tables were found)
    assert missing_owned(ROOT) == []


# ---- each check catches its breach -----------------------------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"shardserve" = "shardserve"\n'
                                             '"shardserve.cluster" = "cluster"\n"shardserve.worker" = "worker"\n')
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_planted_long_file_a_planted_twin_and_a_planted_missing_owner_are_reported(tmp_path):
    root = _tree(tmp_path, {
        "cluster/engine.py": "x = 1\n" * 301, "cluster/worker_pb2.py": "x = 1\n" * 400,
        "cluster/config.py": "", "worker/config.py": "", "worker/cluster.py": "", "worker/__init__.py": "",
        "docs/architecture.md": "## Who owns what\n\n**cluster/** (side)\n\n| file | owns |\n| --- | --- |\n"
                                "| `engine.py`, `gone.py` | x |\n| `worker/` | y |\n\n## Next\n| `never.py` | z |\n",
    })
    assert too_long(root) == {"cluster/engine.py": 301}  # the stub is left out
    assert names_used_twice(root) == {"config": ["cluster/config.py", "worker/config.py"],
                                      "cluster": ["cluster/", "worker/cluster.py"]}
    assert missing_owned(root) == ["cluster/gone.py"]  # worker/ found at the root; the next section not read


@pytest.mark.parametrize("count", [300, 299])
def test_a_file_of_300_lines_or_fewer_passes(tmp_path, count):
    assert too_long(_tree(tmp_path, {"cluster/engine.py": "x = 1\n" * count})) == {}
