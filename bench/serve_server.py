"""The server `shardserve bench serve` starts when it is given none: `shardserve serve` as a subprocess on 127.0.0.1
(its own local Ray unless --ray-address says otherwise) and, when asked, the HTTP gateway: in the serve process
(gateway_workers 0, `serve --http-port`) or as a `shardserve gateway --workers N` process of its own. Each is
stopped with SIGTERM (a drain), then killed with its process group if it does not exit."""

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
    def __init__(self, flags: list[str], http: bool, ray_address: str = "local", ready_timeout_s: float = 900.0,
                 gateway_workers: int = 0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shardserve-bench-serve-", suffix=".log", delete=False)
        self.gateway = None
        in_process = http and gateway_workers == 0
        command = [sys.executable, "-m", "shardserve.cli.main", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
                   "--ray-address", ray_address, "--drain-timeout", "5"] + (["--http-port", "0"] if in_process else [])
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")}
        if ray_address == "local":  # else ray.init() joins any Ray already running on this host (pgrep)
            env["RAY_ADDRESS"] = "local"
        self.proc, lines = self._start(command, env)
        self.address = self.http_url = None
        deadline = time.monotonic() + ready_timeout_s
        try:
            while self.address is None or (in_process and self.http_url is None):
                self.address, self.http_url = self._ready(self.proc, lines, deadline, self.address, self.http_url)
            if http and not in_process:
                self.gateway, lines = self._start([sys.executable, "-m", "shardserve.cli.main", "gateway", "--upstream",
                                                   self.address, "--port", "0", "--workers", str(gateway_workers)],
                                                  env)
                while self.http_url is None:
                    _, self.http_url = self._ready(self.gateway, lines, deadline, None, None)
        except BaseException:
            self.stop()
            raise

    def _start(self, command: list[str], env: dict) -> tuple[subprocess.Popen, queue.SimpleQueue]:
        print(f"bench serve: starting {' '.join(command[1:])} (log: {self.log.name})", file=sys.stderr, flush=True)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                start_new_session=True)  # its own process group: ours to end
        lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        return proc, lines

    def _ready(self, proc, lines, deadline, address, http_url) -> tuple[str | None, str | None]:
        """One line of proc's output read (or none within half a second): the addresses it announced so far."""
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"`shardserve {proc.args[3]}` did not become ready:\n{self.log_tail()}")
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            return address, http_url
        if match := READY.search(line):
            address = match.group(1)
        elif match := GATEWAY_READY.search(line):
            http_url = match.group(1)
        return address, http_url

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def stop(self, timeout_s: float = 90.0) -> None:
        for proc in (self.gateway, self.proc):  # the gateway first: its streams end before the server drains
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
