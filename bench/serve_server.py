"""The server `shardserve bench serve` starts when it is given none: `shardserve serve` as a subprocess on 127.0.0.1
(its own local Ray unless --ray-address says otherwise), the HTTP gateway in it when asked; stopped with SIGTERM
(a drain), then killed with its process group if it does not exit."""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

READY = re.compile(r"shardserve ready: .* serving on (\S+:\d+)")
GATEWAY_READY = re.compile(r"shardserve gateway ready: (http://\S+)/v1")


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user gave `bench serve`, as `serve` takes them: those that differ from their defaults
    (args.engine_defaults, set where the parser was built; each flag is spelled as its dest)."""
    flags = []
    for dest, default in args.engine_defaults.items():
        value = getattr(args, dest, default)
        if value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        flags += [flag] if isinstance(default, bool) else [flag, str(value)]
    return flags


class LaunchedServer:
    def __init__(self, flags: list[str], http: bool, ray_address: str = "local", ready_timeout_s: float = 900.0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shardserve-bench-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "shardserve.cli", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
                   "--ray-address", ray_address, "--drain-timeout", "5"] + (["--http-port", "0"] if http else [])
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")}
        if ray_address == "local":  # else ray.init() joins any Ray already running on this host (pgrep)
            env["RAY_ADDRESS"] = "local"
        print(f"bench serve: starting {' '.join(command[1:])} (log: {self.log.name})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)  # its own process group: ours to end
        lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.address = self.http_url = None
        deadline = time.monotonic() + ready_timeout_s
        try:
            while self.address is None or (http and self.http_url is None):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"`shardserve serve` did not become ready:\n{self.log_tail()}")
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    continue
                if match := READY.search(line):
                    self.address = match.group(1)
                elif match := GATEWAY_READY.search(line):
                    self.http_url = match.group(1)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def stop(self, timeout_s: float = 90.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
