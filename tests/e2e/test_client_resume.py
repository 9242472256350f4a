"""The Python client resumes a stream that broke with UNAVAILABLE: two replicas (TP=2 local processes each, the
controller in a thread, group restarts off), one rank of one group SIGKILLed with 16 streams running: that
replica fails and ends its streams with UNAVAILABLE, the clients send them again with the tokens they have, the
other replica finishes them, and every stream has exactly the tokens of an undisturbed run (greedy and seeded)."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from shardserve.client import Client
from tests.e2e.test_faults_local import NUM_STREAMS, LocalGroups, _run_streams


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
    undisturbed = _run_streams(controller.address)
    victim = groups.groups[0].processes[1]
    disturbed = _run_streams(controller.address, fault=lambda: os.kill(victim.pid, signal.SIGKILL))
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
