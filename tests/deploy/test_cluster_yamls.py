"""The `ray up` cluster files in deploy/: valid for the installed Ray, and their commands do what deploy/README.md says.

Proves: every deploy/*.yaml validates against the JSON schema Ray ships (ray/autoscaler/ray-schema.json) as written,
and again after Ray's own preparation (defaults merged, the on-prem node type made), which is what `ray up` checks
before it contacts any machine; the validator rejects an unexpected key (so a passing file means something); after
Ray merges its defaults, no command calls a bare `pip` or `ray` (the nodes' Python is in ~/shardserve-venv; Ray's
AWS default would pip-install boto3 into a system Python that Ubuntu 24.04 refuses); the head starts Ray with no
GPUs and with the autoscaler; shardserve is installed from the wheel in dist/; every command parses as bash; no AWS
node type leaves its image to Ray's default.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILES = sorted((ROOT / "deploy").glob("*.yaml"))
COMMAND_LISTS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")
VENV_BIN = "~/shardserve-venv/bin/"


def _ray_schema() -> dict:
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed: no ray/autoscaler/ray-schema.json to validate against")
    path = Path(list(spec.submodule_search_locations)[0]) / "autoscaler" / "ray-schema.json"
    if not path.is_file():
        pytest.skip(f"the installed ray has no cluster schema at {path}")
    return json.loads(path.read_text())


def schema_errors(config: dict) -> list[str]:
    """Every violation of Ray's cluster schema, as 'path: message' (empty: valid)."""
    validator = jsonschema.Draft7Validator(_ray_schema())
    errors = validator.iter_errors(config)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in errors)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _prepared(path: Path) -> dict:
    """The config as `ray up` has it before contacting the provider: Ray's defaults merged, on-prem node type made."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(_load(path))


def _ids(paths):
    return [p.name for p in paths]


def test_the_deploy_folder_has_both_cluster_files():
    assert {"aws-gpu.yaml", "onprem.yaml"} <= {p.name for p in CLUSTER_FILES}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_cluster_file_validates_against_rays_schema(path):
    assert schema_errors(_load(path)) == []


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_cluster_file_passes_rays_own_preparation_and_validation(path):
    from ray.autoscaler._private.util import validate_config

    validate_config(_prepared(path))  # raises jsonschema.ValidationError / ValueError on a bad config


@pytest.mark.parametrize("key, value", [("min_workers", 2), ("head_ip", "10.0.0.10")])
def test_validator_rejects_an_unexpected_top_level_key(key, value):
    config = _load(ROOT / "deploy" / "onprem.yaml")
    assert schema_errors(config) == []
    config[key] = value  # a top-level min_workers is what onprem.yaml used to have
    errors = schema_errors(config)
    assert f"<top>: Additional properties are not allowed ('{key}' was unexpected)" in errors


def test_validator_rejects_an_unexpected_key_inside_a_node_type():
    config = _load(ROOT / "deploy" / "aws-gpu.yaml")
    config["available_node_types"]["gpu_8x"]["setup_commands"] = ["true"]  # not allowed per node type
    errors = schema_errors(config)
    assert any(e.startswith("available_node_types/gpu_8x:") and "'setup_commands' was unexpected" in e for e in errors)


def _segments(command: str) -> list[str]:
    """The simple commands of a shell line, split at ; && || | { } ( ) (good enough for these files' commands)."""
    return [s.strip() for s in re.split(r"\|\||&&|[;|{}()]", command) if s.strip()]


def bare_tool_calls(config: dict) -> list[str]:
    """Simple commands in the config's command lists that call pip, pip3 or ray without the venv's path."""
    found = []
    for key in COMMAND_LISTS:
        for command in config.get(key) or []:
            for segment in _segments(command):
                words = segment.split()
                if words[0] == "sudo":
                    words = words[1:]
                if words and words[0] in ("pip", "pip3", "ray"):
                    found.append(f"{key}: {segment}")
    return found


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_no_command_calls_a_bare_pip_or_ray_after_rays_defaults_are_merged(path):
    assert bare_tool_calls(_prepared(path)) == []


def test_bare_tool_check_sees_rays_aws_default_head_setup():
    config = _load(ROOT / "deploy" / "aws-gpu.yaml")
    del config["head_setup_commands"]  # Ray fills in its AWS default: pip install boto3 into the system Python
    from ray.autoscaler._private.util import prepare_config

    assert any("pip install" in call for call in bare_tool_calls(prepare_config(config)))


def _head_start(config: dict) -> str:
    starts = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 1, starts
    return starts[0]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_head_starts_ray_without_gpus_and_with_the_autoscaler(path):
    config = _load(path)
    head = _head_start(config)
    assert f"{VENV_BIN}ray start --head" in head
    assert re.search(r"--num-gpus[= ]0(\s|$)", head), head
    # Without it the head runs no autoscaler, and no worker node is ever started.
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    workers = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert len(workers) == 1 and "--address=$RAY_HEAD_IP:6379" in workers[0], workers


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_shardserve_is_installed_from_the_wheel_built_in_dist(path):
    config = _load(path)
    remote = [r for r, local in config["file_mounts"].items() if local.rstrip("/") in ("./dist", "dist")]
    assert len(remote) == 1, config["file_mounts"]
    installs = [c for c in config["setup_commands"] if "pip install" in c]
    wheel = f"{remote[0]}/shardserve-*.whl"
    assert any(wheel in c for c in installs), installs
    assert not any(re.search(r"pip install\b.*\s-e\s", c) for c in installs), installs


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to parse the commands with")
@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_every_command_parses_as_bash(path):
    config = _load(path)
    bad = []
    for key in COMMAND_LISTS:
        for command in config.get(key) or []:
            result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
            if result.returncode:
                bad.append(f"{key}: {command!r}: {result.stderr.strip()}")
    assert bad == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to parse the commands with")
def test_bash_check_catches_a_broken_command():
    result = subprocess.run(["bash", "-n", "-c", "test -f x || { echo missing"], capture_output=True, text=True)
    assert result.returncode != 0


def test_aws_node_types_name_their_image():
    config = _load(ROOT / "deploy" / "aws-gpu.yaml")
    for name, node_type in config["available_node_types"].items():
        image = node_type["node_config"].get("ImageId", "")
        # "" or "latest_dlami" make Ray substitute its own default AMI (Ubuntu 18.04, Python too old).
        assert image.lower() not in ("", "latest_dlami"), name


def test_prepared_onprem_config_keeps_every_worker_machine():
    config = _prepared(ROOT / "deploy" / "onprem.yaml")
    node_types = config["available_node_types"]
    assert len(node_types) == 1
    (node_type,) = node_types.values()
    workers = len(_load(ROOT / "deploy" / "onprem.yaml")["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == workers

