"""bench scaling's load generator: prompts spread over client processes (each its own gRPC channel) against the
fake upstream (bench/serve_fake.py, a real gRPC server on 127.0.0.1), every answer back in prompt order."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from shardserve.bench.scaling_client import ClientPool


@pytest.fixture
def fake_upstream():
    proc = subprocess.Popen([sys.executable, "-m", "shardserve.bench.serve_fake", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = proc.stdout.readline()
        while "ready" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        match = re.search(r"serving on (\S+)", line)
        assert match, f"the fake upstream did not start: {line!r}"
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_client_pool_spreads_prompts_over_processes_and_returns_them_in_order(fake_upstream):
    prompts = [[100 + i] * (i + 1) for i in range(5)]
    ticks = []
    with ClientPool(2) as pool:
        r = pool.run(fake_upstream, prompts, 7, concurrency=3, on_done=ticks.append)
        again = pool.run(fake_upstream, prompts[:1], 3, concurrency=3)  # the processes take a second job
    assert r["tokens"] == [list(range(5, 12))] * 5  # the fake's tokens: 5, 6, ... per request
    assert r["client_procs"] == 2 and sum(ticks) == 5 and len(r["ttft_s"]) == 5 and len(r["tpot_s"]) == 5
    assert 0 < r["client_cpu_s"] and 0 < r["client_cpu_max"]
    assert again["tokens"] == [[5, 6, 7]] and again["client_procs"] == 1


def test_a_failed_request_raises_its_error_and_the_pool_takes_the_next_job(fake_upstream):
    """A request that fails in a client process (here a token id no request can carry) comes back as a
    RuntimeError naming it, not as a dead pipe; the processes stay in step for the next job."""
    with ClientPool(2) as pool:
        with pytest.raises(RuntimeError, match="client process 1: a request failed"):
            pool.run(fake_upstream, [[100], [2**40], [102]], 3, concurrency=3)  # not an int32
        again = pool.run(fake_upstream, [[100], [101]], 3, concurrency=2)
    assert again["tokens"] == [[5, 6, 7]] * 2
