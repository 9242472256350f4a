"""Several gateway processes on one port (`shardserve gateway --workers N`): the gateway is stateless, so N
processes, each with its own event loop, interpreter lock and gRPC channel, share the streams of one HTTP port.

Each process binds the port with SO_REUSEPORT, and the kernel spreads new connections across the listening sockets.
The process the user started is worker 0 and the supervisor of the other N-1, which it starts as
`shardserve gateway ... --port P --worker-of-parent` on the port it bound (so that --port 0 works): a signal it
receives (SIGTERM, SIGINT) goes on to them, each drains its own responses, and it waits for them. A worker exits
when its standard input closes, so that none outlives a supervisor killed without a chance to stop them.
"""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time

READY = "shardserve gateway ready: "


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        if not hasattr(socket, "SO_REUSEPORT"):
            sock.close()
            raise RuntimeError("several gateway workers need SO_REUSEPORT, which this system lacks")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP gateway to {host}:{port}: {e}") from e
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    return sock


class Workers:
    """Workers 1..count-1 of a gateway whose worker 0 is this process, started on (host, port)."""

    def __init__(self, count: int, upstream: str, host: str, port: int, request_timeout_s: float | None,
                 access_log: bool, upstream_tls: dict | None = None, ready_timeout_s: float = 60.0,
                 limits=None) -> None:
        command = [sys.executable, "-m", "shardserve.cli.main", "gateway", "--upstream", upstream, "--host", host,
                   "--port", str(port), "--worker-of-parent"] + (limits.flags() if limits is not None else [])
        tls = upstream_tls or {}
        if tls.get("tls"):
            command.append("--upstream-tls")
        for key, flag in (("tls_root_cert", "--upstream-tls-ca"), ("tls_client_cert", "--upstream-tls-cert"),
                          ("tls_client_key", "--upstream-tls-key")):
            if tls.get(key):
                command += [flag, tls[key]]  # file paths: the workers read them themselves
        if request_timeout_s is not None:
            command += ["--request-timeout", str(request_timeout_s)]
        if access_log:
            command.append("--access-log")
        self.procs: list[subprocess.Popen] = []
        lines: queue.SimpleQueue = queue.SimpleQueue()
        try:
            for _ in range(count - 1):
                proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)  # signals only through us: one each
                self.procs.append(proc)
                threading.Thread(target=_forward, args=(proc, lines), daemon=True).start()
            ready, deadline = 0, time.monotonic() + ready_timeout_s
            while ready < len(self.procs):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"{len(self.procs) - ready} gateway worker(s) did not start")
                try:
                    ready += lines.get(timeout=0.5).startswith(READY)
                except queue.Empty:
                    pass
        except BaseException:
            self.stop()
            raise

    def signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (each drains, as worker 0 does), then SIGKILL past the timeout."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin:
                proc.stdin.close()


def _forward(proc: subprocess.Popen, lines: queue.SimpleQueue) -> None:
    """A worker's stdout: its ready line to the supervisor, the rest to ours."""
    for line in proc.stdout:
        if line.startswith(READY):
            lines.put(line)
        else:
            sys.stdout.write(line)


def exit_with_stdin(server) -> None:
    """In a worker: uvicorn's graceful shutdown once the supervisor's pipe closes. (Not a SIGTERM to itself: sent
    from this thread under uvloop, it waits for the next signal to reach the main thread.)"""
    def watch() -> None:
        while sys.stdin.read(4096):
            pass
        server.should_exit = True

    threading.Thread(target=watch, name="shardserve-gateway-parent", daemon=True).start()
