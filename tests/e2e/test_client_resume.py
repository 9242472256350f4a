"""The Python client resumes a stream that broke with UNAVAILABLE: two replicas (TP=2 local processes each, the
controller in a thread, group restarts off), one rank of one group SIGKILLed with 16 streams running: that
replica fails and ends its streams with UNAVAILABLE, the clients send them again with the tokens they have, the
other replica finishes them, and every stream has exactly the tokens of an undisturbed run (greedy and seeded)."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from shardserve.client.clients import Client
from tests.e2e._local_groups import NUM_STREAMS, LocalGroups, run_streams, wait_for


@pytest.fixture
def two_replicas(tiny_llama_dir, e2e_config):
    from shardserve.cluster.controller import ControllerConfig, ServedModel
    from shardserve.cluster.engine import Engine
    from tests.e2e._controller_thread import ControllerThread

    groups = LocalGroups(deadline_floor_s=10.0)
    controller = ControllerThread(ControllerConfig(
        engine=e2e_config(tiny_llama_dir, tensor_parallel_size=2, max_num_seqs=NUM_STREAMS),
        model=ServedModel("tiny", "LlamaForCausalLM", vocab_size=384, eos_token_ids=[]),
        build_engine=lambda cfg: Engine(cfg, groups(cfg), vocab_size=384),
        port=0,
        num_replicas=2,
        restart_tries=0,  # a lost group fails its replica: its streams break, the clients resume them
    ))
    try:
        assert controller.call(controller.controller.wait_ready(120))
        yield controller, groups
    finally:
        controller.close()
        groups.stop_all()


def test_streams_broken_by_a_failed_replica_resume_on_the_other_with_the_same_tokens(two_replicas):
    controller, groups = two_replicas
    undisturbed = run_streams(controller.address)
    victim = groups.groups[0].processes[1]
    disturbed = run_streams(controller.address, fault=lambda: os.kill(victim.pid, signal.SIGKILL))
    assert disturbed == undisturbed
    replicas = controller.controller.status()["replicas"]
    assert sorted(replicas.values()) == ["failed", "serving"]


def test_without_resume_the_broken_stream_surfaces_unavailable(two_replicas):
    controller, groups = two_replicas
    with Client(controller.address, timeout=120) as client:
        streams = [client.stream([1, 2, 3 + i], max_tokens=200, ignore_eos=True, temperature=0, resume=False)
                   for i in range(4)]  # routed over both replicas
        iterators = [iter(s) for s in streams]
        for it in iterators:
            next(it)  # every stream under way
        os.kill(groups.groups[0].processes[0].pid, signal.SIGKILL)
        codes = []
        for it in iterators:
            try:
                for _ in it:
                    pass
                codes.append("finished")
            except grpc.RpcError as e:
                codes.append(e.code())
    assert grpc.StatusCode.UNAVAILABLE in codes and "finished" in codes
    assert all(s.num_resumes == 0 for s in streams)


def test_unseeded_sampled_streams_resume_with_the_seed_the_server_drew_and_prompt_logprobs_come_once(two_replicas):
    """Unseeded sampled streams (the server draws their seed at admission and tells it in Started) broken by a
    failed replica resume by default with that seed: each ends with the tokens the same request with that seed
    gives undisturbed. A stream that asked for prompt logprobs gets them on its first delta only."""
    import threading

    controller, groups = two_replicas
    n, max_tokens = 8, 48
    streams: list = [None] * n
    deltas: list[list] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with Client(controller.address, timeout=300) as client:
                streams[i] = client.stream([5 + i, 17, 29 + 3 * i], max_tokens=max_tokens, ignore_eos=True,
                                           temperature=0.9, prompt_logprobs=1)
                for delta in streams[i]:
                    deltas[i].append(delta)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(d) >= 3 for d in deltas) or errors, "every stream under way")
    assert max(sum(len(x.token_ids) for x in d) for d in deltas) < max_tokens, "the streams finished before the fault"
    os.kill(groups.groups[0].processes[1].pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert any(s.num_resumes for s in streams), "no stream was on the failed replica"
    with Client(controller.address, timeout=300) as client:
        for i, stream in enumerate(streams):
            assert stream.seed is not None and [d.prompt_logprobs is not None for d in deltas[i]].count(True) == 1
            again = client.generate([5 + i, 17, 29 + 3 * i], max_tokens=max_tokens, ignore_eos=True,
                                    temperature=0.9, seed=stream.seed)
            assert stream.result.token_ids == again.token_ids, (i, stream.num_resumes)
            assert len(stream.result.prompt_logprobs) == 3
