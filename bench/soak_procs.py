"""The processes of the server `shardserve bench soak` started: finding its worker ranks (to SIGKILL) and sampling
their memory.

serve starts its local Ray in a session of its own (shardserve/launch/local_ray.py): a child of serve leading a session
whose members are Ray's processes (GCS, raylet, the controller and worker actors). Every process found here is one
the soak started (serve, or a descendant of it through that session); nothing else is ever signalled.
"""

from __future__ import annotations

from shardserve.launch.local_ray import command_line, process_table, session_members

WORKER, CONTROLLER = "ray::WorkerActor", "ray::Controller"


def ray_session(serve_pid: int) -> int:
    """The session id of serve's local Ray: the child of serve that leads a session (raises LookupError)."""
    for pid, ppid, session in process_table():
        if ppid == serve_pid and session == pid:
            return pid
    raise LookupError(f"serve (pid {serve_pid}) has no local Ray session: was it started with --ray-address local?")


def worker_pids(session: int) -> list[int]:
    """The live worker-actor processes of the session (every group's, the old ones until they exit)."""
    return sorted(pid for pid in session_members(session) if command_line(pid).startswith(WORKER))


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in kB, from /proc/PID/smaps_rollup; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def memory_sample(serve_pid: int, session: int) -> dict:
    """RSS and PSS in MB per role: serve (the serve process), controller (its actor), workers (every worker
    actor alive), ray (the rest of the session: GCS, raylet, idle Ray workers, the host), and the total."""
    roles = {"serve": [serve_pid], "controller": [], "workers": [], "ray": []}
    for pid in session_members(session):
        line = command_line(pid)
        role = "controller" if line.startswith(CONTROLLER) else "workers" if line.startswith(WORKER) else "ray"
        roles[role].append(pid)
    sample = {}
    for role, pids in roles.items():
        kb = [_memory_kb(pid) for pid in pids]
        sample[role] = {"rss_mb": round(sum(r for r, _ in kb) / 1024, 1), "pss_mb": round(sum(p for _, p in kb) / 1024, 1),
                        "processes": len(pids)}
    sample["total"] = {k: round(sum(v[k] for v in sample.values()), 1) for k in ("rss_mb", "pss_mb")}
    return sample
