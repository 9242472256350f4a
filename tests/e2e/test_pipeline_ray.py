"""A pipelined replica under `start_cluster` (real Ray on loopback, real gRPC, gloo point to point between the
stages): the tiny model in 2 stages of 1 rank. Its placement group holds one bundle per stage; the streams'
tokens equal one rank's; a SIGKILLed rank of the last stage mid-generation replaces the whole group (both stages),
and 16 running streams (greedy and seeded) finish with the tokens of an undisturbed run."""

from __future__ import annotations

import os
import signal

import pytest

from shardserve.client.clients import Client
from shardserve.launch.stage_report import stage_nodes
from tests.e2e._local_groups import MAX_TOKENS, NUM_STREAMS, run_streams


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir, e2e_config):
    from shardserve.launch.ray_serving import start_cluster

    running = start_cluster(e2e_config(tiny_llama_dir, pipeline_parallel_size=2, max_num_seqs=NUM_STREAMS),
                            host="127.0.0.1", port=0, replica_hosts="controller")
    yield running
    running.shutdown(drain_timeout_s=0)


def _ranks(ray, name: str) -> dict[str, int]:
    return {a["Name"]: a["Pid"] for a in ray._private.state.actors().values()
            if (a["Name"] or "").startswith(name) and "-rank" in a["Name"] and a["State"] == "ALIVE"}


def test_a_pipelined_group_places_one_bundle_per_stage_and_names_each_stage_node(cluster, ray_session):
    (group,) = cluster.worker_groups()
    assert len(group.endpoints) == 2 and group.node_ips == ["127.0.0.1", "127.0.0.1"]
    table = ray_session.util.placement_group_table(group.placement_group)
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    assert stage_nodes([group], 1) == "replica 0: stage 0 on 127.0.0.1, stage 1 on 127.0.0.1"


def test_sigkill_of_the_last_stage_restarts_the_whole_group_and_changes_no_token(cluster, ray_session, tiny_llama_dir,
                                                                                 e2e_config):
    from shardserve.launch.ray_serving import start_cluster

    ray = ray_session
    undisturbed = run_streams(cluster.address)
    assert all(len(tokens) == MAX_TOKENS for tokens in undisturbed)
    one_rank = start_cluster(e2e_config(tiny_llama_dir, max_num_seqs=NUM_STREAMS), host="127.0.0.1", port=0,
                             replica_hosts="controller")
    try:
        assert run_streams(one_rank.address) == undisturbed  # the stages compute what one rank does
    finally:
        one_rank.shutdown(drain_timeout_s=0)
    before = _ranks(ray, cluster.name)
    assert len(before) == 2
    victim = next(pid for actor, pid in before.items() if actor.endswith("-rank1"))
    disturbed = run_streams(cluster.address, fault=lambda: os.kill(victim, signal.SIGKILL))
    assert disturbed == undisturbed
    status = cluster.status()
    assert status["group_restarts"] == 1 and status["state"] == "serving"
    after = _ranks(ray, cluster.name)
    assert len(after) == 2 and not set(after) & set(before)  # both stages are new
    with Client(cluster.address, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.server_stats().kv_blocks_used == 0
