"""Every `shardserve ...` command in the user-facing docs runs as written, as far as it can be checked on one machine.

Proves: each command in a bash block of README.md, deploy/README.md and docs/security.md (continuation lines joined,
`.venv/bin/shardserve` and the Docker image's entrypoint included) parses with the real command line; each one that
takes engine flags and names a model this machine has (the default model, a built-in architecture) resolves to an
EngineConfig, which is where a tensor-parallel size that does not divide the model's heads, an unknown dtype or a
missing model is refused. (Running them all would take minutes of loading: the failures users met are all refused
at this point, before any process starts.) Costs ~2 s after the default model's conversion.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shardserve.cli.flags import engine_kwargs
from shardserve.cli.main import build_parser
from shardserve.settings.model_source import BUILTIN_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "deploy/README.md", "docs/security.md")


def doc_commands(markdown: str) -> list[list[str]]:
    """The shardserve commands of the markdown's bash blocks, as argument lists (without the program name)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.split(r"\s#", line, maxsplit=1)[0].strip()
            if not line.startswith(("shardserve ", ".venv/bin/shardserve ", "docker run ")):
                continue
            words = shlex.split(line)
            if words[0] in ("shardserve", ".venv/bin/shardserve"):
                commands.append(words[1:])
            elif words[:2] == ["docker", "run"] and "shardserve" in words:  # the image's entrypoint is shardserve
                commands.append(words[words.index("shardserve") + 1:])
    return commands


def _cases() -> list:
    return [pytest.param(words, id=f"{doc}: {' '.join(words)}"[:120])
            for doc in DOCS for words in doc_commands((ROOT / doc).read_text())]


def _local_model(model) -> bool:
    """The default model or a built-in architecture: what this machine has (folders like /models/... it has not)."""
    return model is None or model in BUILTIN_CONFIGS


def test_the_docs_have_commands():
    assert len(_cases()) >= 15


@pytest.mark.parametrize("words", _cases())
def test_doc_command_runs_as_written(words, default_model_dir, capsys):
    from shardserve.settings.resolve import build_engine_config

    try:
        args = build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"`shardserve {' '.join(words)}` is refused by the command line: "
                    f"{capsys.readouterr().err.strip()} (exit {e.code})")
    if not hasattr(args, "tensor_parallel_size") or not _local_model(getattr(args, "model", None)):
        return
    try:
        build_engine_config(**engine_kwargs(args))
    except (ValueError, TypeError) as e:
        pytest.fail(f"`shardserve {' '.join(words)}` fails: {e}")


def test_a_planted_tensor_parallel_size_the_default_model_refuses_is_caught(default_model_dir):
    from shardserve.settings.resolve import build_engine_config

    (words,) = doc_commands('```bash\nshardserve generate "Hi" -tp 2 --logprobs 3   # comment\n```\n')
    with pytest.raises(ValueError, match="must divide the model's 9 attention heads"):
        build_engine_config(**engine_kwargs(build_parser().parse_args(words)))


def test_every_port_the_deploy_example_opens_is_in_the_port_table_and_the_aws_security_group():
    """deploy/README.md's cluster `serve` opens --port, --http-port and --metrics-port to clients: each is a row of
    its port table and a rule of aws-gpu.yaml's security group."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    yaml_text = (ROOT / "deploy" / "aws-gpu.yaml").read_text()
    serve = next(w for w in doc_commands(readme) if w[0] == "serve" and "--ray-address" in w)
    table = readme.split("## Ports", 1)[1]
    ports = [serve[serve.index(flag) + 1] for flag in ("--port", "--http-port", "--metrics-port") if flag in serve]
    assert len(ports) == 3, serve
    for port in ports:
        assert re.search(rf"^\| {port} \|", table, flags=re.M), f"port {port} is not in deploy/README.md's table"
        assert f"FromPort: {port}, ToPort: {port}" in yaml_text, f"aws-gpu.yaml does not open port {port}"
    assert "One `shardserve serve` runs one TP group" not in readme  # beside --replicas auto, it never did


def test_one_authentication_story_across_the_docs():
    """README, deploy/README and security.md all give the token as --api-key or SHARDSERVE_API_KEY (beside
    --auth-token-file in security.md), and none says the API has no authentication."""
    from shardserve.cli.connection_flags import API_KEY_ENV

    for doc in DOCS:
        text = (ROOT / doc).read_text()
        assert "--api-key" in text and API_KEY_ENV in text, doc
        for stale in ("does not check tokens", "API has no authentication", "API\n  has no authentication"):
            assert stale not in text, (doc, stale)
