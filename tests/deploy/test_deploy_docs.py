"""The deployment docs and the Dockerfile agree with the code and with each other.

Proves: every cluster `shardserve serve` example (one that joins a Ray cluster with --ray-address auto) in README.md
and deploy/README.md passes `--worker-host node`, and deploy/README.md's also passes `--device cuda` (on a CPU-only
head, --device auto would mean CPU workers); every flag those examples use is one `shardserve serve` accepts; the
Dockerfile's base image carries a torch that pyproject's torch requirement allows, and the image installs the wheel.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def serve_commands(markdown: str) -> list[list[str]]:
    """The `shardserve serve ...` commands in the markdown's bash blocks, continuation lines joined, as words."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("shardserve serve"):
                commands.append(line.split())
    return commands


def _flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def cluster_serve_commands(path: Path) -> list[list[str]]:
    return [c for c in serve_commands(path.read_text()) if _flag(c, "--ray-address") == "auto"]


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md"])
def test_cluster_serve_examples_bind_workers_to_their_own_node(doc):
    commands = cluster_serve_commands(ROOT / doc)
    assert commands, f"no cluster `shardserve serve` example in {doc}"
    for words in commands:
        assert _flag(words, "--worker-host") == "node", " ".join(words)


def test_deploy_readme_serves_on_cuda_from_a_cpu_head():
    for words in cluster_serve_commands(ROOT / "deploy" / "README.md"):
        assert _flag(words, "--device") == "cuda", " ".join(words)


def test_serve_command_parser_finds_a_non_node_worker_host():
    doc = "```bash\nshardserve serve --tp 2 --ray-address auto \\\n    --worker-host 10.0.0.1 --port 50051\n```\n"
    (words,) = serve_commands(doc)
    assert _flag(words, "--worker-host") == "10.0.0.1"


def _serve_flags() -> set[str]:
    import argparse

    from shardserve.cli.server_commands import add_cluster_parsers

    sub = argparse.ArgumentParser().add_subparsers()
    add_cluster_parsers(sub)
    serve = sub.choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md"])
def test_serve_examples_use_only_flags_serve_accepts(doc):
    known = _serve_flags()
    for words in serve_commands((ROOT / doc).read_text()):
        unknown = [w for w in words if w.startswith("--") and w not in known]
        assert unknown == [], " ".join(words)


def _torch_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    return torch


def dockerfile_base_image(text: str) -> str:
    """The FROM image, with an ARG default substituted for ${NAME} / $NAME."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    (image,) = re.findall(r"^FROM (\S+)", text, flags=re.M)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)


def test_dockerfile_base_image_carries_the_torch_pyproject_requires():
    image = dockerfile_base_image((ROOT / "deploy" / "Dockerfile").read_text())
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-(runtime|devel)", image)
    assert match, f"{image}: not a pytorch/pytorch tag that names its torch version"
    assert Version(match.group(1)) in _torch_requirement().specifier, (image, str(_torch_requirement()))


def test_the_previous_base_image_would_not_pass():
    old = "FROM nvcr.io/nvidia/pytorch:25.10-py3\n"
    assert re.fullmatch(r"pytorch/pytorch:.*", dockerfile_base_image(old)) is None
    assert Version("2.9.0") not in _torch_requirement().specifier  # an older torch fails the version check


def test_dockerfile_installs_the_wheel_and_keeps_the_context_to_dist():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"pip install .*dist/shardserve-\*\.whl", text)
    assert not re.search(r"pip install [^\n]*-e \.", text)
    lines = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    assert [line for line in lines if line and not line.startswith("#")] == ["*", "!dist"]
