"""init_local_ray: a Ray start whose raylet did not register in time is cleaned up and tried again.

Ray's own failure (its raylet not registering within 30 s, seen once on a loaded CI host) cannot be caused on
purpose, so ray.init is replaced here by one that does what a failed start does: it starts processes (a real child)
and raises Ray's error. Everything else is real: the children found in /proc, their end, the warning, the retry.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray

from shardserve.launch import local_ray

RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")


def alive(pid: int) -> bool:
    return pid in {p for p, _, _ in local_ray.process_table()}


class FailingInit:
    """ray.init failing `failures` times as Ray does: a child process left running, then the timeout error."""

    def __init__(self, failures: int):
        self.failures, self.calls, self.left = failures, [], []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            self.left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
            raise RAY_TIMEOUT


def test_a_start_that_timed_out_is_cleaned_up_and_tried_again(monkeypatch):
    init = FailingInit(failures=1)
    monkeypatch.setattr(ray, "init", init)
    with pytest.warns(RuntimeWarning, match=r"Ray did not start \(try 1 of 2\)"):
        local_ray.init_local_ray(3, log_to_driver=False)
    assert len(init.calls) == 2
    assert init.calls[1] == dict(address="local", num_cpus=3, include_dashboard=False, logging_level="warning",
                                 log_to_driver=False)
    assert not alive(init.left[0]), "the failed start's process outlived it"


def test_the_last_failed_try_raises_with_ray_s_error(monkeypatch):
    init = FailingInit(failures=2)
    monkeypatch.setattr(ray, "init", init)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="did not start in 2 tries: The current node"):
        local_ray.init_local_ray(2)
    assert len(init.calls) == 2 and not any(alive(pid) for pid in init.left)


def test_other_errors_are_not_retried(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError):
        local_ray.init_local_ray(2)
    assert len(calls) == 1


def test_log_tails_come_from_this_process_s_newest_session(tmp_path):
    for name, text in [(f"session_2026-12-01_10-00-00_000001_{os.getpid()}", "old"),
                       (f"session_2026-12-02_10-00-00_000001_{os.getpid()}", "new"),
                       ("session_2026-12-03_10-00-00_000001_1", "another process's")]:
        (tmp_path / name / "logs").mkdir(parents=True)
        (tmp_path / name / "logs" / "raylet.out").write_text("".join(f"{text} line {i}\n" for i in range(30)))
    tails = local_ray._session_log_tails(str(tmp_path))
    assert "raylet.out (last 20 lines)" in tails
    assert "new line 29" in tails and "new line 9\n" not in tails
    assert "old" not in tails and "another" not in tails


@pytest.mark.parametrize("stuck", [True, False])
def test_a_stuck_shutdown_of_a_broken_ray_takes_rays_exit_hook_off(monkeypatch, stuck):
    """shutdown_broken_ray waits timeout_s at most; when ray.shutdown is still stuck (a dead GCS), Ray's exit hook,
    which would call it again at the interpreter's exit and wait on the stuck one's lock, is taken off; a shutdown
    that finished leaves the hook alone."""
    import atexit
    import threading

    release = threading.Event()
    calls, unregistered = [], []

    def shutdown(*args, **kwargs):
        calls.append(1)
        if stuck:
            release.wait(10)

    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    try:
        local_ray.shutdown_broken_ray(0.05)
    finally:
        release.set()
    assert calls == [1]
    assert unregistered == ([shutdown] if stuck else [])
