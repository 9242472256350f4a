"""A worker actor killed mid-generation under `start_cluster` (real Ray on loopback, real gRPC, gloo): its TP
group is replaced by a fresh one (a new placement group and new worker actors, the old ones gone) and 16 running
streams (greedy and seeded) finish with the tokens of an undisturbed run. The tiny model at TP=2."""

from __future__ import annotations

import os
import signal

import pytest

from shardserve.client.clients import Client
from tests.e2e._local_groups import MAX_TOKENS, NUM_STREAMS, run_streams


@pytest.fixture(scope="module", params=["controller", "process"])
def cluster(request, ray_session, tiny_llama_dir, e2e_config):
    """The replica's engine in the controller process, then in a host process of its own (the restart runs there)."""
    from shardserve.launch.ray_serving import start_cluster

    running = start_cluster(e2e_config(tiny_llama_dir, tensor_parallel_size=2, max_num_seqs=NUM_STREAMS),
                            host="127.0.0.1", port=0, replica_hosts=request.param)
    yield running
    running.shutdown(drain_timeout_s=0)


def _ranks(ray, name: str) -> dict[str, int]:
    """Live worker actors of this cluster: actor name -> pid."""
    return {a["Name"]: a["Pid"] for a in ray._private.state.actors().values()
            if (a["Name"] or "").startswith(name) and "-rank" in a["Name"] and a["State"] == "ALIVE"}


def test_sigkill_of_a_worker_actor_with_16_streams_loses_no_request_and_changes_no_token(cluster, ray_session):
    ray = ray_session
    undisturbed = run_streams(cluster.address)
    assert all(len(tokens) == MAX_TOKENS for tokens in undisturbed)
    before = _ranks(ray, cluster.name)
    assert len(before) == 2
    victim = next(pid for actor, pid in before.items() if actor.endswith("-rank1"))
    disturbed = run_streams(cluster.address, fault=lambda: os.kill(victim, signal.SIGKILL),
                             resume=False)  # the server carries the streams over, not the client
    assert disturbed == undisturbed
    status = cluster.status()
    assert status["group_restarts"] == 1 and status["state"] == "serving"
    after = _ranks(ray, cluster.name)
    assert len(after) == 2 and not set(after) & set(before)  # a fresh group; the old ranks are gone
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith(cluster.name)]
    if "-host" in "".join(g["name"] for g in groups):  # a replica host's placement group holds every group of it
        assert [g["state"] for g in groups] == ["CREATED"]
    else:
        assert sorted(g["state"] for g in groups) == ["CREATED", "REMOVED"]  # the failed group's placement was removed
    with Client(cluster.address, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.server_stats().kv_blocks_used == 0
