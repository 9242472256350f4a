"""The local Ray of `shardserve serve`, in a session of its own, so that a signal to serve's process group leaves
it running until serve has drained.

`ray.init()` called by serve would start Ray's processes (GCS, raylet, the worker processes that host the
controller and worker actors) as serve's children, in serve's process group. A signal to the whole group (systemd's
default KillMode, `kill -- -PGID`, Ctrl-C in a terminal) would then kill the controller and the workers at the same
moment as it asks serve to drain: nothing would be left to drain and serve would wait for a GCS that is gone.

So serve starts a small host process in a new session (its own process group): it runs `ray.init()` there, prints
the GCS address and keeps Ray until its stdin closes (serve closed it, or serve died) or it is sent SIGTERM, then
shuts Ray down. serve connects to that address like to any cluster. `LocalRay.stop` closes the pipe, waits for the
host, then ends whatever is left in the host's session (only processes the host started are in it).

    ray_host = LocalRay.start(num_cpus=8)     # then ray.init(address=ray_host.address)
    ...
    ray.shutdown(); ray_host.stop()

`init_local_ray` is the one place a new local Ray starts (the host, `ensure_ray("local")`, the test session): it
starts again once when Ray's raylet does not register with its GCS in time.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass

RAY_START_TRIES = 2
VITAL_RAY_PROCESSES = ("gcs_server", "raylet")  # without either, the local Ray cannot go on
HOST_WATCH_S = 1.0  # how often the host looks at them
BROKEN_SHUTDOWN_S = 1.0  # ray.shutdown's time once its Ray is gone (shutdown_broken_ray; the rest is swept)


@dataclass
class LocalRay:
    address: str  # the GCS address, "127.0.0.1:port"
    process: subprocess.Popen  # the host: leader of its own session and process group

    @classmethod
    def start(cls, num_cpus: int, timeout_s: float = 120.0) -> LocalRay:
        """Starts the host and waits for its GCS address; raises RuntimeError when it fails or is too slow."""
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, for the host and for this process
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # the host starts a new Ray; it must not look for another
        proc = subprocess.Popen([sys.executable, "-m", "shardserve.launch.local_ray", str(num_cpus)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        host = cls("", proc)
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line.endswith("\n"):
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                host.stop(timeout_s=5.0)
                raise RuntimeError(f"the local Ray did not start within {timeout_s:g} s (exit code {proc.returncode})")
            if select.select([proc.stdout], [], [], min(left, 0.5))[0]:
                line += proc.stdout.readline() or ""
        host.address, _, auth_mode = line.strip().partition(" ")
        if auth_mode and os.environ.get("RAY_AUTH_MODE") != auth_mode:
            _use_auth_mode(auth_mode)
        return host

    @property
    def exited(self) -> bool:
        """Whether the host has exited (asked to, or not: then Ray went with it, killed or broken)."""
        return self.process.poll() is not None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Asks the host to shut Ray down (closes its stdin), waits up to timeout_s for it, then ends what is left
        of its process group (SIGTERM, then SIGKILL, 5 s each; SIGKILL at once when the host had gone before it was
        asked: Ray then had no orderly shutdown, and what is left of it may not heed SIGTERM)."""
        host_gone = self.exited
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        sid = self.process.pid  # the host's session: every process it started (Ray's workers have groups of their own)
        signals = (signal.SIGKILL,) if host_gone else (signal.SIGTERM, signal.SIGKILL)
        for sig in signals:  # whatever the host's shutdown left
            left = session_members(sid)
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            until = time.monotonic() + 5.0
            while left and (left := session_members(sid)) and time.monotonic() < until:
                time.sleep(0.05)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5.0)


def init_local_ray(num_cpus: int, tries: int = RAY_START_TRIES, **options) -> None:
    """ray.init of a new Ray of this process's own (address "local": never one found through RAY_ADDRESS or
    /tmp/ray/ray_current_cluster), no dashboard, logging at warning; options go to ray.init.

    Ray gives its raylet 30 s to register with the GCS and then raises, leaving the processes it started behind.
    A start that fails so is cleaned up (this process's new children end) and tried again, up to `tries` starts in
    all; the tail of its logs goes into a warning (and into the error when the last try fails) to say why."""
    import ray

    options = {"include_dashboard": False, "logging_level": "warning", **options}
    for attempt in range(1, tries + 1):
        before = set(_children())
        try:
            ray.init(address="local", num_cpus=num_cpus, **options)
            return
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            logs = _session_log_tails(options.get("_temp_dir"))
            _end_processes(set(_children()) - before)
            if attempt == tries:
                raise RuntimeError(f"Ray did not start in {tries} tries: {e}\n{logs}") from e
            warnings.warn(f"Ray did not start (try {attempt} of {tries}): {e}; starting it again.\n{logs}",
                          RuntimeWarning, stacklevel=2)


def _children() -> list[int]:
    """This process's live children, from /proc."""
    me = os.getpid()
    return [pid for pid, ppid, _ in process_table() if ppid == me]


def process_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, session id) of every live (not zombie) process, from /proc."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(int(entry))
        except OSError:
            continue
        if fields[0] != "Z":
            table.append((int(entry), int(fields[1]), int(fields[3])))
    return table


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, session, ... (OSError when the process is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2:].split()


def _end_processes(pids: set[int], timeout_s: float = 5.0) -> None:
    """SIGKILL to each pid (processes this process started), then reaps them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # reaped elsewhere (subprocess) or not a child any more
                break
            time.sleep(0.05)


def _session_log_tails(temp_dir: str | None = None, lines: int = 20) -> str:
    """The last lines of the GCS's and raylet's logs of the newest Ray session this process started (Ray names
    session folders session_<time>_<pid of the starting process>), in temp_dir (None: Ray's default)."""
    if temp_dir is None:
        from ray._common.utils import get_default_ray_temp_dir

        temp_dir = get_default_ray_temp_dir()
    try:
        mine = sorted(d for d in os.listdir(temp_dir) if d.startswith("session_") and d.endswith(f"_{os.getpid()}"))
    except OSError:
        return ""
    if not mine:
        return ""
    logs = os.path.join(temp_dir, mine[-1], "logs")
    out = []
    for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
        try:
            with open(os.path.join(logs, name), errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            continue
        if tail:
            out.append(f"--- {os.path.join(logs, name)} (last {len(tail)} lines)\n" + "".join(tail))
    return "\n".join(out)


def _use_auth_mode(mode: str) -> None:
    """This process connects next with the host's authentication mode (the token itself is read from ~/.ray, where
    the host's ray.init put it); Ray reads the mode into its config once, so the config is read again."""
    os.environ["RAY_AUTH_MODE"] = mode
    from ray._raylet import Config

    Config.initialize("")


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session sid, from /proc."""
    return [pid for pid, _, session in process_table() if session == sid]


def _host(num_cpus: int) -> None:
    """The host process: Ray up, its address out, then wait for stdin's end (or SIGTERM) and shut Ray down. It also
    watches Ray's GCS and raylet (its children): when one dies, Ray is broken for good (every process connected to
    it aborts a minute later), so the host says which, shuts down what is left and exits 1 at once; serve, which
    watches the host, then stops too and sweeps this session."""
    import ray

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only serve decides when Ray goes
    init_local_ray(num_cpus, log_to_driver=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # after ray.init, which sets its own
    vital = {pid: name for pid in _children() if (name := _command_name(pid)) in VITAL_RAY_PROCESSES}
    try:
        # Ray's token authentication (on by default for a new local Ray): the one connecting must turn it on too
        print(ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE", ""), flush=True)
        while not select.select([sys.stdin], [], [], HOST_WATCH_S)[0] or os.read(sys.stdin.fileno(), 4096):
            if dead := [f"{name} (pid {pid})" for pid, name in vital.items() if not _alive(pid)]:
                print(f"shardserve: the local Ray's {', '.join(dead)} died: shutting it down", file=sys.stderr,
                      flush=True)
                shutdown_broken_ray()  # serve sweeps this session of what is left
                exit_past_broken_ray(1)
    finally:
        ray.shutdown()


_RAY_BROKEN = False  # this process was connected to a Ray that died under it (shutdown_broken_ray ran)


def shutdown_broken_ray(timeout_s: float = BROKEN_SHUTDOWN_S) -> None:
    """ray.shutdown for a Ray whose GCS is gone, which it would wait on for many seconds: given timeout_s at most,
    in a daemon thread (what it leaves is swept by LocalRay.stop). Ray's own exit hook (ray.shutdown again, at the
    interpreter's exit) is taken off: it would wait on the stuck shutdown's lock (serve's exit took 5 s more).
    The process should then end by exit_past_broken_ray."""
    import atexit

    import ray

    global _RAY_BROKEN
    _RAY_BROKEN = True

    shutdown = threading.Thread(target=ray.shutdown, daemon=True)
    shutdown.start()
    shutdown.join(timeout_s)
    if shutdown.is_alive():
        atexit.unregister(ray.shutdown)


def exit_past_broken_ray(code: int) -> int:
    """code, or, where this process's Ray died under it (shutdown_broken_ray ran), the process ended at once with
    code (logging, stdout and stderr flushed), skipping the interpreter's finalization and the C++ teardown of a
    normal exit: Ray's client threads may still run, its shutdown given up on a dead GCS. serve with a killed local
    Ray, having said so and returned 1, died of SIGSEGV now and then (in CI, and in repeated runs; never since this),
    with no Python traceback under faulthandler: past the interpreter, in
    the exit's teardown under those threads (inferred). The local Ray's host process leaves the same way."""
    if _RAY_BROKEN:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not): two reads of /proc a second, not a scan of every process."""
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces (as a Ray worker retitles itself: "ray::Name");
    "" when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _command_name(pid: int) -> str:
    """The file name of a process's executable as started (argv[0]'s last part), "" when it is gone."""
    return os.path.basename(command_line(pid).split(" ", 1)[0])


if __name__ == "__main__":
    _host(int(sys.argv[1]))
