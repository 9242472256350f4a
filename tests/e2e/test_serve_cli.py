"""`shardserve serve` and `shardserve client` as a user runs them: separate processes, real Ray (serve joins the
test session's Ray on loopback), real gRPC. The default model at TP=1 keeps it quick.

Proves: serve prints a ready line with its address once SERVING; --replicas 2 answers from both replicas; a
SIGKILLed controller breaks no stream and serve's new one adopts the running replica hosts; the client CLI streams text, reports server errors
with their status, and runs a JSON-lines batch in input order; SIGTERM lets an in-flight request finish, refuses new
ones, exits 0 and leaves no actor or placement group behind.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from shardserve.client.clients import Client

READY = re.compile(r"shardserve ready: .* serving on (\S+:\d+)")


class ServeProcess:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardserve.cli.main", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.stdout: queue.SimpleQueue = queue.SimpleQueue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(pipe, sink) -> None:
        for line in pipe:
            sink(line)

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"serve exited early:\n{''.join(self.stderr)[-3000:]}"
                continue
            if match := READY.search(line):
                self.ready_line = line
                return match.group(1)
        raise AssertionError(f"no ready line within {timeout_s} s:\n{''.join(self.stderr)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _client_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli.main", "client", *args], capture_output=True, text=True,
                          timeout=timeout)


def serve_default_model(ray_session, model_dir: str, *extra: str) -> ServeProcess:
    """`shardserve serve` of the default model at TP=1 on CPU, joining the session's Ray, on a free port."""
    ray_port = ray_session.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    return ServeProcess([
        "--model", model_dir, "--device", "cpu", "--tp", "1", "--num-kv-blocks", "64",
        "--max-model-len", "512", "--port", "0", "--ray-address", f"127.0.0.1:{ray_port}", *extra,
    ])


@pytest.fixture(scope="module")
def served(ray_session, default_model_dir):
    server = serve_default_model(ray_session, default_model_dir, "--drain-timeout", "60")
    try:
        address = server.wait_ready(180)
        yield server, address
    finally:
        server.stop()


def test_ready_line_and_model_info_name_the_model_without_server_paths(served, default_model_dir):
    from shardserve.client.clients import Client

    server, address = served
    with Client(address, timeout=30) as client:
        info = client.model_info()
    assert server.ready_line.startswith("shardserve ready: SmolLM2-135M-Instruct (tp=1, replicas=1, cpu)")
    assert server.ready_line.rstrip().endswith("; no OpenAI HTTP API (--http-port 8000 adds it)")  # where vLLM's is
    assert info.model == "SmolLM2-135M-Instruct" and info.tokenizer == info.model
    assert default_model_dir not in server.ready_line and "/" not in info.model + info.tokenizer


def test_client_cli_streams_the_text_of_one_prompt(served):
    _, address = served
    run = _client_cli("The capital of France is", "--address", address, "--max-tokens", "8")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "[length: " in run.stderr and "8 generated" in run.stderr


def test_client_cli_reports_a_server_error_with_its_status(served):
    _, address = served
    run = _client_cli("hello", "--address", address, "--temperature", "-1")
    assert run.returncode == 1
    assert "INVALID_ARGUMENT" in run.stderr and "temperature" in run.stderr


def test_client_cli_prints_the_logprobs_it_was_asked_for(served):
    _, address = served
    run = _client_cli("The capital of France is", "--address", address, "--max-tokens", "3", "--logprobs", "2")
    assert run.returncode == 0, run.stderr
    assert "[generated logprobs: token (logprob, rank) | top]" in run.stderr
    assert len([line for line in run.stderr.splitlines() if line.startswith("  '")]) == 3  # one line a token


def test_client_cli_runs_a_jsonl_batch_and_writes_results_in_input_order(served, tmp_path):
    """Per-line fields are kept (logprobs, stop and its stop_reason, cached tokens); a line that is not JSON, or
    has no prompt, gets an error record naming the file and line, and the lines after it are still sent."""
    _, address = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"id": "a", "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 1},
        {"id": "b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6},
        {"id": "c", "prompt": "x", "temperature": -1},
        {"id": "d", "token_ids": [504, 2988, 314], "max_tokens": 3},
    ]) + "\n{not json\n" + json.dumps({"id": "f", "text": "no prompt key"}) + "\n"
        + json.dumps({"id": "g", "prompt": "The capital of France is", "max_tokens": 8, "stop": [" Paris"]}) + "\n")
    out = tmp_path / "results.jsonl"
    run = _client_cli("--file", str(prompts), "--concurrency", "3", "--address", address, "--output", str(out))
    assert run.returncode == 1  # three lines failed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("id") for r in records] == ["a", "b", "c", "d", None, "f", "g"]
    assert [r["index"] for r in records] == list(range(7)) and [r["line"] for r in records] == list(range(1, 8))
    assert "Paris" in records[0]["text"] and records[0]["usage"]["completion_tokens"] == 4
    assert len(records[0]["logprobs"]) == 4 and records[0]["logprobs"][0][0]["rank"] >= 1
    assert "cached_prompt_tokens" in records[0]["usage"] and "logprobs" not in records[1]
    assert records[1]["text"] and records[1]["usage"]["completion_tokens"] <= 6
    assert records[2]["error"]["code"] == "INVALID_ARGUMENT"
    assert len(records[3]["token_ids"]) == 3
    for bad in (records[4], records[5]):
        assert bad["error"]["code"] == "INVALID_ARGUMENT" and f"{prompts} line {bad['line']}" in bad["error"]["message"]
    assert records[6]["finish_reason"] == "stop" and records[6]["stop_reason"] == " Paris"
    assert f"{prompts} line 5" in run.stderr and "7/7" in run.stderr  # the progress bar reached the end


def test_serve_with_two_replicas_answers_from_both_and_warns_about_spread_placement(ray_session, default_model_dir):
    server = serve_default_model(ray_session, default_model_dir, "--replicas", "2", "--routing", "round-robin",
                                 "--placement", "spread")
    try:
        address = server.wait_ready(300)
        with Client(address, timeout=120) as client:
            answered_by = {client.generate("Hello", max_tokens=2).replica for _ in range(4)}
            info = client.model_info()
        assert len(answered_by) == 2 and info.replicas == 2
        assert "network speed" in "".join(server.stderr)
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_serve_replaces_a_sigkilled_controller_by_adopting_its_hosts_and_a_stream_goes_on(ray_session,
                                                                                            default_model_dir):
    """Two replicas (host processes, one front): the controller's SIGKILL mid-stream breaks no stream (resume off),
    and serve's new controller adopts the same host processes (nothing loaded again) and serves."""
    import os

    server = serve_default_model(ray_session, default_model_dir, "--replicas", "2")
    try:
        address = server.wait_ready(300)
        with Client(address, timeout=120) as client:
            name = client.generate("Hello", max_tokens=2).replica.split("/")[0]
            actors = {a["Name"]: a["Pid"] for a in ray_session._private.state.actors().values()
                      if (a["Name"] or "").startswith(name) and a["State"] == "ALIVE"}
            hosts = {k: v for k, v in actors.items() if "-host" in k}
            assert len(hosts) == 2
            stream = client.stream("Write a poem about autumn", temperature=0, max_tokens=48, ignore_eos=True,
                                   resume=False)
            tokens = list(next(iter(stream)).token_ids)
            os.kill(actors[f"{name}-controller"], signal.SIGKILL)
            for delta in stream:
                tokens += delta.token_ids
            assert len(tokens) == 48
            deadline, said = time.monotonic() + 120, []
            while not any("ready again" in line for line in said):
                assert time.monotonic() < deadline and server.proc.poll() is None, "".join(server.stderr)[-3000:]
                try:
                    said.append(server.stdout.get(timeout=0.1))
                except queue.Empty:
                    pass
            alive = {a["Name"]: a["Pid"] for a in ray_session._private.state.actors().values()
                     if (a["Name"] or "").startswith(name) and "-host" in (a["Name"] or "") and a["State"] == "ALIVE"}
            assert alive == hosts  # the same processes: no weights loaded again
            assert client.generate("Hello", max_tokens=2).replica.startswith(name)
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_sigterm_lets_in_flight_requests_finish_then_exits_0_leaving_nothing(served, ray_session):
    """Runs last: it stops the module's server."""
    server, address = served
    ray = ray_session
    outcome: dict = {}
    first_delta = threading.Event()

    def in_flight():
        with Client(address, timeout=120) as client:
            stream = client.stream("Write a poem about autumn", temperature=0, max_tokens=96, ignore_eos=True)
            for _ in stream:
                first_delta.set()
            outcome["result"] = stream.result

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert first_delta.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    with Client(address, timeout=30) as client:  # draining: health flips, new requests are refused
        deadline = time.monotonic() + 30
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hello", max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    thread.join(120)
    result = outcome["result"]
    assert result.finish_reason == "length" and result.usage.completion_tokens == 96
    assert server.proc.wait(60) == 0
    assert "0 request(s) cut off" in "".join(server.stderr)
    name = result.replica.split("/")[0]
    actors = [a for a in ray._private.state.actors().values() if (a["Name"] or "").startswith(name)]
    assert actors and all(a["State"] == "DEAD" for a in actors)  # the controller and the worker
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith(name)]
    assert groups and all(g["state"] == "REMOVED" for g in groups)
    deadline = time.monotonic() + 30
    while any(_alive(a["Pid"]) for a in actors):
        assert time.monotonic() < deadline, "an actor process outlived serve"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return pid > 0 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
