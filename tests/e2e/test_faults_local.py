"""A worker that dies or stops mid-generation costs no request: the controller (in a thread) drives TP=2 local
worker processes over real gRPC and gloo; SIGKILL or SIGSTOP one rank with 16 streams running and every stream
finishes with the tokens of an undisturbed run (greedy and seeded), after a pause while a new group starts.
No Ray: each group, the first and every restart, is new local processes started by the replica's factory (Ray's is in
test_faults_ray.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from shardserve.client import Client
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


def _controller(config, make_executor):
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


@pytest.fixture
def served(tiny_llama_dir, e2e_config):
    groups = LocalGroups(deadline_floor_s=2.0)
    controller = _controller(e2e_config(tiny_llama_dir, tensor_parallel_size=2, max_num_seqs=NUM_STREAMS), groups)
    try:
        assert controller.call(controller.controller.wait_ready(120))
        yield controller, groups
    finally:
        controller.close()
        groups.stop_all()


def _requests() -> list[tuple[list[int], dict]]:
    """8 greedy and 8 seeded requests, prompts of different lengths (token ids of the tiny model's vocabulary)."""
    out = []
    for i in range(NUM_STREAMS):
        prompt = [1 + (7 * i + j) % 300 for j in range(3 + i % 5)]
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=1000 + i)
        out.append((prompt, dict(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)))
    return out


def _run_streams(address: str, fault=None) -> list[list[int]]:
    """Runs every request as a stream at once; once every stream has a few tokens, fault() runs (once).
    Returns each stream's tokens; a stream that errors fails the test."""
    received: list[list[int]] = [[] for _ in range(NUM_STREAMS)]
    errors: list[BaseException] = []

    def consume(i: int, prompt, sampling) -> None:
        try:
            with Client(address, timeout=300) as client:
                for delta in client.stream(prompt, **sampling):
                    received[i] += delta.token_ids
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i, *req), daemon=True) for i, req in enumerate(_requests())]
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


def _wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigkill_of_a_rank_with_16_streams_loses_no_request_and_changes_no_token(served):
    controller, groups = served
    undisturbed = _run_streams(controller.address)
    assert all(len(tokens) == MAX_TOKENS for tokens in undisturbed)
    victim = groups.groups[0].processes[1]
    disturbed = _run_streams(controller.address, fault=lambda: os.kill(victim.pid, signal.SIGKILL))
    assert disturbed == undisturbed
    status = controller.controller.status()
    assert status["group_restarts"] == 1 and len(groups.groups) == 2 and status["state"] == "serving"
    with Client(controller.address, timeout=30) as client:
        assert client.health() == "SERVING"
        stats = client.server_stats()
        assert stats.kv_blocks_used == 0  # every block of the new group is back


def test_sigstop_of_a_rank_turns_health_not_serving_then_the_group_is_replaced(served):
    controller, groups = served
    undisturbed = _run_streams(controller.address)
    victim = groups.groups[0].processes[1]
    seen_not_serving = threading.Event()

    def stop_and_watch() -> None:
        os.kill(victim.pid, signal.SIGSTOP)
        with Client(controller.address, timeout=30) as client:  # within the step deadline (2 s floor here)
            _wait_for(lambda: client.health() == "NOT_SERVING", "health NOT_SERVING after SIGSTOP", 60)
        seen_not_serving.set()

    disturbed = _run_streams(controller.address, fault=stop_and_watch)
    assert seen_not_serving.is_set()
    assert disturbed == undisturbed
    assert controller.controller.status()["group_restarts"] >= 1
    victim.join(30)  # the stopped rank was killed with its group, not left behind
    assert not victim.is_alive()


def test_a_group_that_cannot_come_back_ends_streams_with_unavailable_and_health_and_stats_still_answer(
        tiny_llama_dir, e2e_config):
    import grpc

    groups = LocalGroups(deadline_floor_s=2.0)
    tries: list[int] = []

    def first_group_only(config):
        if not groups.groups:
            return groups(config)
        tries.append(1)
        raise RuntimeError("no placement for a new group")

    controller = _controller(e2e_config(tiny_llama_dir, tensor_parallel_size=2), first_group_only)
    try:
        assert controller.call(controller.controller.wait_ready(120))
        with Client(controller.address, timeout=120) as client:
            stream = client.stream([1, 2, 3], max_tokens=200, ignore_eos=True)
            first = next(iter(stream))  # under way
            assert first.token_ids
            os.kill(groups.groups[0].processes[0].pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as error:
                for _ in stream:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(tries) == 3  # the bounded number of tries, then it gave up
            assert client.health() == "NOT_SERVING"
            client.server_stats()  # still answers
            with pytest.raises(grpc.RpcError) as error:
                client.generate([1, 2, 3], max_tokens=4)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert controller.controller.status()["state"] == "failed"
    finally:
        controller.close()
        groups.stop_all()


def test_an_idle_server_replaces_a_dead_group_before_any_request_needs_it(served):
    """No step runs, so only the health probe can notice: health NOT_SERVING, then a new group and SERVING again."""
    controller, groups = served
    with Client(controller.address, timeout=30) as client:
        assert client.health() == "SERVING"
        os.kill(groups.groups[0].processes[0].pid, signal.SIGKILL)
        _wait_for(lambda: client.health() == "NOT_SERVING", "health NOT_SERVING with a dead rank", 60)
        _wait_for(lambda: client.health() == "SERVING", "a new group serving", 180)
        assert controller.controller.status()["group_restarts"] == 1 and len(groups.groups) == 2
        assert client.generate([1, 2, 3], max_tokens=8, ignore_eos=True).usage.completion_tokens == 8
