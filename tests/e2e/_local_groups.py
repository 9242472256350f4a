"""Local tensor-parallel groups for fault tests: the executor factory (a new TP group of local processes each call),
the controller in a thread over it, and 16 streams (greedy and seeded) run at once with an optional fault midway.
Shared by test_faults_local.py, test_client_resume.py, test_faults_ray.py and test_serve_signals.py."""

from __future__ import annotations

import os
import signal
import threading
import time

from shardserve.client.clients import Client
from shardserve.cluster.step_deadline import StepDeadline

NUM_STREAMS = 16
MAX_TOKENS = 96


class LocalGroups:
    """The executor factory: a new TP group of local processes each call (the first and each restart); keeps them."""

    def __init__(self, deadline_floor_s: float) -> None:
        self.groups: list = []
        self.deadline_floor_s = deadline_floor_s

    def __call__(self, config):
        from shardserve.cluster.executor import GrpcExecutor
        from shardserve.worker.local_workers import start_local_workers

        workers = start_local_workers(config)
        self.groups.append(workers)
        deadline = StepDeadline(floor_s=self.deadline_floor_s, initial_s=max(self.deadline_floor_s, 30.0))
        return GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop,
                            deadline=deadline, secret=workers.secret)

    def stop_all(self) -> None:
        for workers in self.groups:
            for proc in workers.processes:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGCONT)
            workers.stop(timeout_s=5.0)


def local_controller(config, make_executor):
    """The controller over groups that make_executor starts: the first one, and each restart's."""
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from shardserve.cluster.engine import Engine
    from tests.e2e._controller_thread import ControllerThread

    return ControllerThread(ControllerConfig(
        engine=config,
        model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=384, eos_token_ids=[]),
        build_engine=lambda cfg: Engine(cfg, make_executor(cfg), vocab_size=384),
        port=0,
        restart_tries=3,
        restart_backoff_s=0.5,
        health_check_interval_s=0.5,
    ))


def stream_requests() -> list[tuple[list[int], dict]]:
    """8 greedy and 8 seeded requests, prompts of different lengths (token ids of the tiny model's vocabulary)."""
    out = []
    for i in range(NUM_STREAMS):
        prompt = [1 + (7 * i + j) % 300 for j in range(3 + i % 5)]
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=1000 + i)
        out.append((prompt, dict(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)))
    return out


def run_streams(address: str, fault=None, resume: bool = True) -> list[list[int]]:
    """Runs every request as a stream at once; once every stream has a few tokens, fault() runs (once).
    Returns each stream's tokens; a stream that errors fails the test. resume=False: the client never sends a
    request again, so only the server's own carrying over can finish a stream the fault touched."""
    received: list[list[int]] = [[] for _ in range(NUM_STREAMS)]
    errors: list[BaseException] = []

    def consume(i: int, prompt, sampling) -> None:
        try:
            with Client(address, timeout=300) as client:
                for delta in client.stream(prompt, resume=resume, **sampling):
                    received[i] += delta.token_ids
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i, *req), daemon=True) for i, req in enumerate(stream_requests())]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while min(len(r) for r in received) < 4:  # mid-generation: every stream under way
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        assert max(len(r) for r in received) < MAX_TOKENS, "the streams finished before the fault"
        fault()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return received


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
