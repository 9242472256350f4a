"""SIGTERM to the whole process group of `shardserve serve` (systemd's default KillMode, `kill -- -PGID`) drains
and exits 0 with no process left: serve starts its local Ray in a session of its own (shardserve/local_ray.py), so
the signal reaches serve alone, which drains through the controller, then stops that Ray.

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

from shardserve.client import Client
from shardserve.local_ray import session_members

READY = re.compile(r"shardserve ready: .* serving on (\S+:\d+)")
DRAIN_S = 5.0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _wait_for(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_to_the_process_group_drains_exits_0_and_leaves_no_process(tiny_llama_dir):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve.cli", "serve", "--model", tiny_llama_dir, "--device", "cpu", "--tp", "2",
         "--num-kv-blocks", "64", "--max-model-len", "256", "--port", "0", "--ray-address", "local",
         "--drain-timeout", str(DRAIN_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    lines: queue.SimpleQueue = queue.SimpleQueue()
    stderr: list[str] = []
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [stderr.append(x) for x in proc.stderr], daemon=True).start()
    ray_sessions: list[int] = []
    try:
        address = None
        deadline = time.monotonic() + 300
        while address is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(stderr)[-3000:]
            try:
                match = READY.search(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            address = match.group(1) if match else None
        ray_sessions = [pid for pid in _children(proc.pid) if session_members(pid)]  # the local Ray's host
        assert len(ray_sessions) == 1 and ray_sessions[0] != proc.pid

        results: list = []

        def stream() -> None:  # runs through the drain: it finishes, or is cut off with UNAVAILABLE
            try:
                with Client(address, timeout=120) as client:
                    results.append(client.generate([1, 2, 3], max_tokens=200, ignore_eos=True).finish_reason)
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
        assert proc.returncode == 0, "".join(stderr)[-3000:]
        assert set(results) <= {"length", grpc.StatusCode.UNAVAILABLE} and len(results) == 4
        for sid in (proc.pid, *ray_sessions):
            _wait_for(lambda sid=sid: not session_members(sid), f"session {sid} to be empty", 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for sid in ray_sessions:
            for pid in session_members(sid):
                os.kill(pid, signal.SIGKILL)
