"""Replicas in host processes of their own (cluster/replica_host.py, shardserve/launch/replica_actors.py) under
`start_cluster` (real Ray on loopback, real gRPC, the tiny Llama at TP=1, two replicas).

Proves: each replica's engine runs in a process that is neither the controller's nor another replica's; the greedy
tokens equal one in-process engine's and every answer names its replica; the per-replica stats and the cache reset
that `bench scaling` uses work through the hosts; a SIGKILLed host is replaced: the streams it ran end with UNAVAILABLE and resume on the other replica with the
tokens of an undisturbed run, its TP group's actors die with it, the server keeps serving, and a new host process
with a new group serves the replica again."""

from __future__ import annotations

import os
import signal

import pytest

from shardserve.client.clients import Client
from tests.e2e._local_groups import NUM_STREAMS, run_streams, wait_for
from tests.e2e.test_replicas import _generate_all, _reference, _unrelated


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir, e2e_config):
    from shardserve.launch.ray_serving import start_cluster

    config = e2e_config(tiny_llama_dir, num_kv_blocks=128, max_num_seqs=NUM_STREAMS)
    running = start_cluster(config, host="127.0.0.1", port=0, replicas=2, routing="round-robin")
    yield running, config
    running.shutdown(drain_timeout_s=0)


def _actors(ray, name: str, kind: str) -> dict[str, int]:
    """Live actors of this cluster whose name holds kind ("-host", "-rank"): actor name -> pid."""
    return {a["Name"]: a["Pid"] for a in ray._private.state.actors().values()
            if (a["Name"] or "").startswith(name) and kind in a["Name"] and a["State"] == "ALIVE"}


def _hosts(ray, name: str) -> dict[str, int]:
    return _actors(ray, name, "-host")


def test_each_replica_runs_in_a_host_process_of_its_own(cluster, ray_session):
    running, _ = cluster
    hosts = _hosts(ray_session, running.name)
    controller_pid = ray_session.get(running.controller.pid.remote())
    assert sorted(hosts) == [f"{running.name}-host0", f"{running.name}-host1"]
    assert len(set(hosts.values()) | {controller_pid}) == 3


def test_outputs_equal_one_engines_and_name_their_replica(cluster):
    running, config = cluster
    prompts = [_unrelated(i) for i in range(8)]
    outputs = _generate_all(running.address, prompts)
    assert [o.token_ids for o in outputs] == _reference(config, prompts)
    assert {o.replica for o in outputs} == {f"{running.name}/0", f"{running.name}/1"}


def test_replica_stats_and_reset_caches_work_through_the_hosts(cluster, ray_session):
    running, _ = cluster
    _generate_all(running.address, [_unrelated(100 + i) for i in range(4)])
    rows = ray_session.get(running.controller.replica_stats.remote())
    assert [r["state"] for r in rows] == ["serving", "serving"]
    assert all(r["routed"] > 0 and r["prompt_tokens"] > 0 and r["step_s"] > 0 and r["forward_s"] > 0 for r in rows)
    assert ray_session.get(running.controller.reset_caches.remote("cache-aware", 40)) == [40, 40]
    groups = running.worker_groups()
    assert len(groups) == 2 and all(g is not None and len(g.endpoints) == 1 for g in groups)


def test_a_sigkilled_host_is_replaced_and_its_streams_resume_with_equal_tokens(cluster, ray_session):
    running, config = cluster
    ray_session.get(running.controller.reset_caches.remote("round-robin", None))
    undisturbed = run_streams(running.address)
    victim = _hosts(ray_session, running.name)[f"{running.name}-host1"]
    disturbed = run_streams(running.address, fault=lambda: os.kill(victim, signal.SIGKILL))
    assert disturbed == undisturbed
    assert running.status()["replicas"][f"{running.name}/0"] == "serving"  # never disturbed
    # a new host (a new process, with a new TP group) serves replica 1 again
    wait_for(lambda: running.status()["replicas"][f"{running.name}/1"] == "serving"
             and running.status()["group_restarts"] == 1, "replica 1 to serve again from a new host")
    hosts = _hosts(ray_session, running.name)
    assert sorted(hosts) == [f"{running.name}-host0", f"{running.name}-host1"]
    assert hosts[f"{running.name}-host1"] != victim
    wait_for(lambda: len(_actors(ray_session, running.name, "-rank")) == 2, "the dead host's rank gone, a new one up")
    wait_for(lambda: all(f["replicas"][f"{running.name}/1"] == "serving"
                         for f in ray_session.get(running.controller.front_statuses.remote())),
             "the front to find replica 1's new host")
    wait_for(lambda: running.status()["live_requests"] == 0, "the fronts' counts to show no live request")
    assert running.status()["state"] == "serving"
    prompts = [_unrelated(200 + i) for i in range(4)]
    outputs = _generate_all(running.address, prompts)  # round-robin: both replicas answer
    assert {o.replica for o in outputs} == {f"{running.name}/0", f"{running.name}/1"}
    assert [o.token_ids for o in outputs] == _reference(config, prompts)  # the new host's tokens are right
