"""The import rules of the house, checked on the source: no circles, no upward or sideways imports.

Every module of the package (the folders map to shardserve.* as pyproject.toml's package-dir says) is parsed, not
imported; an edge is any import of one of our modules, at module level, inside a function (a lazy import still
makes a circle) or under TYPE_CHECKING, with `from shardserve.x import y` counted as an import of shardserve.x.y
where y is a module.

The floors, top to bottom: the face (shardserve/ and its rooms) and bench/ -> cluster/ and worker/ -> kernels/, with proto/
under both sides. The rules:
  - no import circles;
  - cluster/ and worker/ never import each other, and cluster/ never imports kernels/;
  - kernels/ imports only kernels/; proto/ imports only proto/;
  - nothing below the face (cluster/, worker/, kernels/, proto/) imports the face (`shardserve`, shardserve.api.llm,
    shardserve.cli.main, ...) or shardserve.bench;
  - worker/layers never imports worker/models;
  - bench/ never reaches into private names (`_x`) of worker/ or kernels/, nor into another object's private
    attributes (`runner._state`);
  - every import of shardserve.* names a module that exists.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = "shardserve"
BELOW_FACE = ("cluster", "worker", "kernels", "proto")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. shardserve.kernels.backends
    target: str  # imported module of ours
    names: tuple[str, ...]  # the names taken from it (`from target import a, b`); () for `import target`
    where: str  # file:line of the import

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def package_dirs(root: Path) -> dict[str, Path]:
    """Package name -> its folder, from pyproject.toml's [tool.setuptools.package-dir]."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in mapping.items()}


def find_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file; a package's __init__.py is the package itself."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def import_edges(modules: dict[str, Path], root: Path) -> tuple[list[Edge], list[str]]:
    """Every import of one of our modules; and the imports of shardserve.* names that are no module."""
    edges, unknown = [], []
    for source, path in modules.items():
        package = source if path.stem == "__init__" else source.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.append((submodule, ()) if submodule in modules else (base, (alias.name,)))
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            for name, names in found:
                if name != TOP and not name.startswith(TOP + "."):
                    continue
                if name not in modules:
                    unknown.append(f"{source} imports {name}, which is no module of ours ({where})")
                    continue
                edges.append(Edge(source, name, names, where))
    return edges, unknown


def layer(module: str) -> str:
    """face, bench, cluster, worker, kernels or proto."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in BELOW_FACE + ("bench",):
        return "face"
    return parts[1]


def forbidden(edge: Edge) -> str | None:
    """Why this edge breaks the rules, or None."""
    src, dst = layer(edge.source), layer(edge.target)
    if {src, dst} == {"cluster", "worker"}:
        return "cluster/ and worker/ never import each other"
    if src == "cluster" and dst == "kernels":
        return "cluster/ never imports kernels/ (the controller touches no tensor)"
    if src == "kernels" and dst != "kernels":
        return "kernels/ imports only kernels/"
    if src == "proto" and dst != "proto":
        return "proto/ imports only proto/"
    if src in BELOW_FACE and dst in ("face", "bench"):
        return f"{src}/ is below the face: it never imports the face or bench/"
    if edge.source.startswith(f"{TOP}.worker.layers") and edge.target.startswith(f"{TOP}.worker.models"):
        return "worker/layers never imports worker/models"
    if src == "bench" and dst in ("worker", "kernels"):
        path = edge.target.split(".") + list(edge.names)
        if any(part.startswith("_") and not part.startswith("__") for part in path):
            return f"bench/ never imports private names of {dst}/"
    return None


def private_attribute_uses(modules: dict[str, Path], root: Path, layer_name: str) -> list[str]:
    """`obj._name` in a layer's modules where obj is not self or cls: reaching into another object's internals."""
    found = []
    for module, path in modules.items():
        if layer(module) != layer_name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{module} uses the private attribute {ast.unparse(node)} "
                             f"({path.relative_to(root)}:{node.lineno})")
    return found


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The import circles: in each strongly connected component of the graph (Tarjan), the shortest circle through
    each member, as its edges."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
        graph.setdefault(edge.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # recursive: our graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    circles, seen = [], set()
    for component in components:  # the shortest circle through each member, each circle once
        for member in sorted(component):
            circle = _circle_in(member, component, graph)
            key = frozenset((e.source, e.target) for e in circle)
            if key not in seen:
                seen.add(key)
                circles.append(circle)
    return circles


def _circle_in(start: str, component: set[str], graph: dict[str, dict[str, Edge]]) -> list[Edge]:
    """The shortest path start -> ... -> start inside the component (breadth first)."""
    previous: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in sorted(graph[node].items()):
                if nxt not in component or nxt in previous:
                    continue
                previous[nxt] = edge
                if nxt == start:
                    circle = [edge]
                    while circle[0].source != start:
                        circle.insert(0, previous[circle[0].source])
                    return circle
                following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def layering_problems(root: Path, packages: dict[str, Path]) -> list[str]:
    """Every breach of the rules above, one readable line each (a circle lists its edges)."""
    modules = find_modules(packages)
    edges, problems = import_edges(modules, root)
    for edge in edges:
        reason = forbidden(edge)
        if reason:
            problems.append(f"forbidden edge {edge}: {reason}")
    problems += private_attribute_uses(modules, root, "bench")
    for circle in cycles(edges):
        problems.append("import circle " + " -> ".join([circle[0].source] + [e.target for e in circle]) + ": "
                        + "; ".join(str(e) for e in circle))
    return problems


def test_the_package_has_no_import_circle_and_no_forbidden_import():
    packages = package_dirs(ROOT)
    assert find_modules(packages), "no modules found: pyproject.toml's package-dir moved?"
    problems = layering_problems(ROOT, packages)
    assert not problems, f"{len(problems)} layering problem(s):\n  " + "\n  ".join(problems)


# ---- the checker catches what it must: a tree with planted bad edges ------------------------------------------
def _plant(root: Path, files: dict[str, str]) -> dict[str, Path]:
    packages = {"shardserve": "shardserve", "shardserve.api": "shardserve/api", "shardserve.settings": "shardserve/settings",
                "shardserve.cluster": "cluster", "shardserve.worker": "worker",
                "shardserve.worker.layers": "worker/layers", "shardserve.worker.models": "worker/models",
                "shardserve.kernels": "kernels", "shardserve.proto": "proto", "shardserve.bench": "bench"}
    for folder in packages.values():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return {package: root / folder for package, folder in packages.items()}


def _problems(tmp_path: Path, files: dict[str, str]) -> list[str]:
    return layering_problems(tmp_path, _plant(tmp_path, files))


def test_a_clean_planted_tree_passes(tmp_path):
    assert _problems(tmp_path, {
        "kernels/store_kv.py": "import torch\n",
        "kernels/backends.py": "from shardserve.kernels import store_kv\n",
        "proto/plan.py": "from dataclasses import dataclass\n",
        "worker/layers/attention.py": "from shardserve.kernels.backends import AttentionBackend\n",
        "worker/models/llama.py": "from shardserve.worker.layers import attention\nfrom shardserve.proto.plan import X\n",
        "cluster/engine.py": "from shardserve.proto.plan import StepPlan\n",
        "shardserve/api/llm.py": "from shardserve.cluster.engine import Engine\nfrom shardserve.worker.models import llama\n",
        "bench/probe.py": "from shardserve.worker.models.llama import Llama\n\ndef f(self):\n    return self._x\n",
    }) == []


def test_a_planted_kernels_to_worker_import_and_a_planted_circle_are_reported(tmp_path):
    problems = _problems(tmp_path, {
        "kernels/backends.py": "def get():\n    from shardserve.worker.layers.attention import Attention\n",
        "worker/layers/attention.py": "import torch\n",
        "bench/offline.py": "from shardserve.bench import control_plane\n",
        "bench/control_plane.py": "def main():\n    from shardserve.bench.offline import run_engine\n",
    })
    assert problems == [
        "forbidden edge shardserve.kernels.backends -> shardserve.worker.layers.attention (kernels/backends.py:2): "
        "kernels/ imports only kernels/",
        "import circle shardserve.bench.control_plane -> shardserve.bench.offline -> shardserve.bench.control_plane: "
        "shardserve.bench.control_plane -> shardserve.bench.offline (bench/control_plane.py:2); "
        "shardserve.bench.offline -> shardserve.bench.control_plane (bench/offline.py:1)",
    ]


@pytest.mark.parametrize("files, expected", [
    ({"cluster/engine.py": "from shardserve.worker import model_runner\n", "worker/model_runner.py": ""},
     "shardserve.cluster.engine -> shardserve.worker.model_runner (cluster/engine.py:1): cluster/ and worker/"),
    ({"worker/sampler.py": "import shardserve.cluster.sampling_params\n", "cluster/sampling_params.py": ""},
     "shardserve.worker.sampler -> shardserve.cluster.sampling_params (worker/sampler.py:1): cluster/ and worker/"),
    ({"cluster/scheduler.py": "from shardserve.kernels import backends\n", "kernels/backends.py": ""},
     "shardserve.cluster.scheduler -> shardserve.kernels.backends (cluster/scheduler.py:1): cluster/ never imports"),
    ({"proto/plan.py": "from shardserve.kernels.backends import X\n", "kernels/backends.py": ""},
     "shardserve.proto.plan -> shardserve.kernels.backends (proto/plan.py:1): proto/ imports only proto/"),
    ({"cluster/engine.py": "from shardserve import SamplingParams\n"},
     "shardserve.cluster.engine -> shardserve (cluster/engine.py:1): cluster/ is below the face"),
    ({"worker/loader.py": "def f():\n    from shardserve.settings.resolve import X\n", "shardserve/settings/resolve.py": ""},
     "shardserve.worker.loader -> shardserve.settings.resolve (worker/loader.py:2): worker/ is below the face"),
    ({"cluster/engine.py": "import shardserve.bench.harness\n", "bench/harness.py": ""},
     "shardserve.cluster.engine -> shardserve.bench.harness (cluster/engine.py:1): cluster/ is below the face"),
    ({"worker/layers/linear.py": "from shardserve.worker.models.llama import X\n", "worker/models/llama.py": ""},
     "shardserve.worker.layers.linear -> shardserve.worker.models.llama (worker/layers/linear.py:1): worker/layers"),
    ({"bench/probe.py": "from shardserve.worker.cuda_graphs import _capture\n", "worker/cuda_graphs.py": ""},
     "shardserve.bench.probe -> shardserve.worker.cuda_graphs (bench/probe.py:1): bench/ never imports private"),
    ({"bench/probe.py": "from shardserve.worker.layers import _fused\n", "worker/layers/_fused.py": ""},
     "shardserve.bench.probe -> shardserve.worker.layers._fused (bench/probe.py:1): bench/ never imports private"),
    ({"bench/probe.py": "def f(graphs):\n    return graphs._graphs[1]\n"},
     "shardserve.bench.probe uses the private attribute graphs._graphs (bench/probe.py:2)"),
    ({"kernels/flash.py": "from shardserve.kernels.reference import X\n"},
     "shardserve.kernels.flash imports shardserve.kernels.reference, which is no module of ours (kernels/flash.py:1)"),
    ({"worker/a.py": "from shardserve.worker import b\n", "worker/b.py": "from . import c\n",
      "worker/c.py": "import shardserve.worker.a\n"},
     "import circle shardserve.worker.a -> shardserve.worker.b -> shardserve.worker.c -> shardserve.worker.a: "),
])
def test_each_rule_reports_its_planted_breach(tmp_path, files, expected):
    problems = _problems(tmp_path, files)
    assert len(problems) == 1 and expected in problems[0], problems
