"""`shardserve serve` as a user runs it, hit from outside. SIGTERM to its whole process group (systemd's default
KillMode, `kill -- -PGID`) drains and exits 0 with no process left: serve starts its local Ray in a session of its
own (shardserve/launch/local_ray.py), so the signal reaches serve alone, which drains through the controller, then stops
that Ray. A SIGKILLed controller actor is started again on the same address, and resuming clients finish their
streams with the tokens of an undisturbed run.

serve runs here as a user runs it: its own process (and group), its own local Ray (`--ray-address local`), the tiny
model at TP=2 (the controller and two worker actors).
"""

from __future__ import annotations

import os
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
from shardserve.launch.local_ray import process_table, command_line, session_members

READY = re.compile(r"shardserve ready: .* serving on (\S+:\d+)")
DRAIN_S = 5.0


def _children(pid: int) -> list[int]:
    return [child for child, parent, _ in process_table() if parent == pid]


def wait_for(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Serve:
    """`shardserve serve` of the tiny model at TP=2 on its own local Ray, in a process group of its own."""

    def __init__(self, model_dir: str, *extra: str) -> None:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardserve.cli.main", "serve", "--model", model_dir, "--device", "cpu", "--tp", "2",
             "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "16", "--ray-address", "local",
             "--drain-timeout", str(DRAIN_S), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.stderr: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        threading.Thread(target=lambda: [self.stderr.append(x) for x in self.proc.stderr], daemon=True).start()
        self.ray_sessions: list[int] = []

    def wait_ready(self, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.stderr)[-3000:]
            try:
                match = READY.search(self.lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if match:
                self.ray_sessions = [pid for pid in _children(self.proc.pid) if session_members(pid)]
                return match.group(1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for sid in self.ray_sessions:
            for pid in session_members(sid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_process_group_drains_exits_0_and_leaves_no_process(tiny_llama_dir):
    serve = Serve(tiny_llama_dir, "--port", "0")
    proc = serve.proc
    try:
        address = serve.wait_ready()
        ray_sessions = serve.ray_sessions  # the local Ray's host
        assert len(ray_sessions) == 1 and ray_sessions[0] != proc.pid

        results: list = []

        def stream() -> None:  # runs through the drain: it finishes, or is cut off with UNAVAILABLE
            try:
                with Client(address, timeout=120) as client:
                    results.append(client.generate([1, 2, 3], max_tokens=200, ignore_eos=True,
                                                   resume=False).finish_reason)
            except grpc.RpcError as e:
                results.append(e.code())

        with Client(address, timeout=60) as client:
            assert client.generate([1, 2, 3], max_tokens=4).usage.completion_tokens == 4
        streams = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        for t in streams:
            t.start()
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as systemd does
        proc.wait(timeout=DRAIN_S + 90)
        for t in streams:
            t.join(60)
        assert proc.returncode == 0, "".join(serve.stderr)[-3000:]
        assert set(results) <= {"length", grpc.StatusCode.UNAVAILABLE} and len(results) == 4
        for sid in (proc.pid, *ray_sessions):
            wait_for(lambda sid=sid: not session_members(sid), f"session {sid} to be empty", 30)
    finally:
        serve.kill()


def test_a_killed_controller_is_started_again_and_resuming_clients_lose_nothing(tiny_llama_dir):
    """The controller keeps its address across its restart, so serve is given a fixed port."""
    from shardserve.proto.transport import free_port
    from tests.e2e._local_groups import run_streams

    serve = Serve(tiny_llama_dir, "--port", str(free_port()))
    try:
        address = serve.wait_ready()
        undisturbed = run_streams(address)
        (controller,) = [pid for pid in session_members(serve.ray_sessions[0])
                         if command_line(pid).startswith("ray::Controller")]
        disturbed = run_streams(address, fault=lambda: os.kill(controller, signal.SIGKILL))  # clients resume
        assert disturbed == undisturbed
        assert "starting it again (1/3)" in "".join(serve.stderr)
        os.killpg(serve.proc.pid, signal.SIGTERM)
        serve.proc.wait(timeout=DRAIN_S + 90)
        assert serve.proc.returncode == 0
    finally:
        serve.kill()


@pytest.mark.parametrize("victim", ["host", "gcs_server"])
def test_a_killed_local_ray_stops_serve_at_once_with_exit_1_and_leaves_no_process(tiny_llama_dir, victim):
    """SIGKILL to serve's local Ray: its host process (GCS, raylet and every actor go with it), or its GCS alone
    (Ray is then broken for good: everything connected to it aborts a minute later). serve says so and exits 1
    within seconds, and nothing of that Ray is left."""
    serve = Serve(tiny_llama_dir, "--port", "0")
    try:
        serve.wait_ready()
        (host,) = serve.ray_sessions
        if victim == "host":
            pid, said = host, f"the local Ray (pid {host}) exited with code -9"
        else:
            (pid,) = [p for p in session_members(host) if command_line(p).split(" ")[0].endswith("/gcs_server")]
            said = f"the local Ray's gcs_server (pid {pid}) died"
        os.kill(pid, signal.SIGKILL)
        assert serve.proc.wait(timeout=30) == 1
        wait_for(lambda: said in "".join(serve.stderr), f"serve to say: {said}", 10)
        wait_for(lambda: not session_members(host), f"session {host} to be empty", 30)
    finally:
        serve.kill()
