"""Mistakes a user makes on the command line end in one line naming the flag or file, a non-zero exit, and no
traceback, before anything slow (Ray, model loading) starts. Each drives the real CLI as a subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) \S+\.py:\d+ -- ")  # Ray's own start-up lines


def shardserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "shardserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    """A port some other process listens on (this test's own socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this host has CUDA: the error needs a host without it"
)
def test_generate_on_cuda_without_a_gpu_names_the_flag():
    assert_one_line_error(shardserve("generate", "hi", "--device", "cuda"), "--device cuda", "has 0")


def test_serve_on_cuda_without_enough_gpus_in_the_ray_cluster_names_the_flag():
    # a local Ray on this host: no GPU here (skipped above where there is one), so --tp 2 cannot be placed either
    if __import__("torch").cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    done = shardserve("serve", "--device", "cuda", "--tp", "2", "--port", "0", "--ray-address", "local",
                      "--load-format", "dummy", "--model", "qwen3-0.6b")
    ours = [line for line in done.stderr.splitlines() if line.strip() and not RAY_LOG_LINE.match(line)]
    assert_one_line_error(subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "\n".join(ours)),
                          "--device cuda", "--tp 2", "Ray cluster", "has 0")


def test_serve_on_a_port_in_use_is_refused_before_ray_starts(busy_port):
    done = shardserve("serve", "--port", str(busy_port), "--device", "cpu", "--ray-address", "local")
    assert_one_line_error(done, f"--port {busy_port}", "127.0.0.1")
    assert "ray" not in done.stdout.lower()


def test_serve_with_a_metrics_port_in_use_is_refused(busy_port):
    done = shardserve("serve", "--port", "0", "--metrics-port", str(busy_port), "--device", "cpu")
    assert_one_line_error(done, f"--metrics-port {busy_port}")


def test_serve_with_zero_replicas_names_the_flag():
    assert_one_line_error(shardserve("serve", "--port", "0", "--replicas", "0", "--device", "cpu"), "--replicas 0")


def test_client_with_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "prompts.jsonl"
    assert_one_line_error(shardserve("client", "--file", str(missing)), "--file", str(missing), "does not exist")


def test_unsupported_architecture_names_the_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    line = assert_one_line_error(
        shardserve("generate", "hi", "--model", str(tmp_path), "--load-format", "dummy"),
        "GPT2LMHeadModel", "config.json", "LlamaForCausalLM",
    )
    assert "num_attention_heads" not in line


def test_a_config_that_is_not_a_json_object_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert_one_line_error(shardserve("generate", "hi", "--model", str(tmp_path), "--load-format", "dummy"),
                          "config.json", "expected a JSON object")


def test_missing_path_and_folder_without_config_are_told_apart(tmp_path):
    assert_one_line_error(shardserve("generate", "hi", "--model", str(tmp_path / "nope")), "does not exist")
    assert_one_line_error(shardserve("generate", "hi", "--model", str(tmp_path)), "has no config.json")


def test_folder_without_weights_names_the_flag_not_the_keyword(tmp_path, tiny_model):
    import shutil

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model("llama", num_heads=4, num_kv_heads=2), folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    assert_one_line_error(shardserve("generate", "hi", "--model", str(folder)), "--load-format dummy")


def test_serve_with_a_zero_stream_interval_names_the_flag():
    assert_one_line_error(shardserve("serve", "--port", "0", "--stream-interval", "0", "--device", "cpu"),
                          "--stream-interval 0")
