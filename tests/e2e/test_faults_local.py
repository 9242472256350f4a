"""A worker that dies or stops mid-generation costs no request: the controller (in a thread) drives TP=2 local
worker processes over real gRPC and gloo; SIGKILL or SIGSTOP one rank with 16 streams running and every stream
finishes with the tokens of an undisturbed run (greedy and seeded), after a pause while a new group starts. A group
that comes back with a smaller KV cache ends the requests it cannot hold with RESOURCE_EXHAUSTED.
No Ray: each group, the first and every restart, is new local processes started by the replica's factory (Ray's is in
test_faults_ray.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from shardserve.client.clients import Client
from tests.e2e._local_groups import MAX_TOKENS, NUM_STREAMS, LocalGroups, local_controller, run_streams, wait_for

@pytest.fixture
def served(tiny_llama_dir, e2e_config):
    groups = LocalGroups(deadline_floor_s=2.0)
    controller = local_controller(e2e_config(tiny_llama_dir, tensor_parallel_size=2, max_num_seqs=NUM_STREAMS), groups)
    try:
        assert controller.call(controller.controller.wait_ready(120))
        yield controller, groups
    finally:
        controller.close()
        groups.stop_all()


def test_sigkill_of_a_rank_with_16_streams_loses_no_request_and_changes_no_token(served):
    controller, groups = served
    undisturbed = run_streams(controller.address)
    assert all(len(tokens) == MAX_TOKENS for tokens in undisturbed)
    victim = groups.groups[0].processes[1]
    disturbed = run_streams(controller.address, fault=lambda: os.kill(victim.pid, signal.SIGKILL),
                             resume=False)  # the server carries the streams over, not the client
    assert disturbed == undisturbed
    status = controller.controller.status()
    assert status["group_restarts"] == 1 and len(groups.groups) == 2 and status["state"] == "serving"
    with Client(controller.address, timeout=30) as client:
        assert client.health() == "SERVING"
        stats = client.server_stats()
        assert stats.kv_blocks_used == 0  # every block of the new group is back


def test_sigstop_of_a_rank_turns_health_not_serving_then_the_group_is_replaced(served):
    controller, groups = served
    undisturbed = run_streams(controller.address)
    victim = groups.groups[0].processes[1]
    seen_not_serving = threading.Event()

    def stop_and_watch() -> None:
        os.kill(victim.pid, signal.SIGSTOP)
        with Client(controller.address, timeout=30) as client:  # within the step deadline (2 s floor here)
            wait_for(lambda: client.health() == "NOT_SERVING", "health NOT_SERVING after SIGSTOP", 60)
        seen_not_serving.set()

    disturbed = run_streams(controller.address, fault=stop_and_watch,
                             resume=False)  # the server carries the streams over, not the client
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

    controller = local_controller(e2e_config(tiny_llama_dir, tensor_parallel_size=2), first_group_only)
    try:
        assert controller.call(controller.controller.wait_ready(120))
        with Client(controller.address, timeout=120) as client:
            # the server's answer, not the client's resuming (which would retry for resume_timeout_s first)
            stream = client.stream([1, 2, 3], max_tokens=200, ignore_eos=True, resume=False)
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
        before = client.generate([1, 2, 3], max_tokens=8, ignore_eos=True, temperature=0).token_ids
        os.kill(groups.groups[0].processes[0].pid, signal.SIGKILL)
        wait_for(lambda: client.health() == "NOT_SERVING", "health NOT_SERVING with a dead rank", 60)
        wait_for(lambda: client.health() == "SERVING", "a new group serving", 180)
        assert controller.controller.status()["group_restarts"] == 1 and len(groups.groups) == 2
        after = client.generate([1, 2, 3], max_tokens=8, ignore_eos=True, temperature=0).token_ids
        assert len(after) == 8 and after == before  # the new group loaded the same weights


def test_a_stream_the_smaller_cache_of_the_new_group_cannot_hold_ends_with_resource_exhausted(tiny_llama_dir,
                                                                                                 e2e_config):
    """The group comes back with 8 KV blocks instead of 64: a live request needing more (prompt + max_tokens: 38
    blocks of 16) ends at once with RESOURCE_EXHAUSTED and the reason, not a hang; a small one (4 blocks) finishes."""
    import dataclasses

    import grpc

    groups = LocalGroups(deadline_floor_s=2.0)
    smaller = lambda cfg: groups(dataclasses.replace(cfg, num_kv_blocks=8) if groups.groups else cfg)  # noqa: E731
    controller = local_controller(e2e_config(tiny_llama_dir, tensor_parallel_size=2, max_model_len=1024), smaller)
    try:
        assert controller.call(controller.controller.wait_ready(120))
        with Client(controller.address, timeout=300) as client:
            big = client.stream([1, 2, 3], max_tokens=600, ignore_eos=True, temperature=0, resume=False)
            small = client.stream([4, 5, 6], max_tokens=60, ignore_eos=True, temperature=0, resume=False)
            big_tokens, small_tokens = iter(big), iter(small)
            next(big_tokens), next(small_tokens)  # both under way
            os.kill(groups.groups[0].processes[1].pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as error:
                for _ in big_tokens:
                    pass
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "holds 8 blocks" in error.value.details() and "needs 38" in error.value.details()
            for _ in small_tokens:
                pass
            assert small.result.usage.completion_tokens == 60 and len(groups.groups) == 2
    finally:
        controller.close()
        groups.stop_all()
