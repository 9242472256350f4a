"""The front tier (cluster/front_process.py, cluster/front_fleet.py) under `start_cluster` with replica hosts: real Ray
on loopback, real gRPC, the tiny Llama at TP=1, two replicas behind two front processes sharing one port.

Proves: the client API is served by front processes that are neither the controller nor a replica host; the
greedy tokens equal one engine's; the controller is off the token path: SIGKILLed mid-stream, every stream of a
client that does not resume finishes with the tokens of an undisturbed run; a new controller adopts the running
hosts and fronts (the hosts' processes are the same: no weights loaded again); a SIGKILLed front's streams resume
through the other front with equal tokens and the controller starts it again."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e._local_groups import run_streams, wait_for
from tests.e2e.test_replica_hosts import _actors, _hosts
from tests.e2e.test_replicas import _generate_all, _reference, _unrelated


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir, e2e_config):
    from shardserve.launch.ray_serving import start_cluster

    config = e2e_config(tiny_llama_dir, num_kv_blocks=128, max_num_seqs=16)
    running = start_cluster(config, host="127.0.0.1", port=0, replicas=2, fronts=2, routing="round-robin")
    box = {"running": running}
    yield box, config
    box["running"].shutdown(drain_timeout_s=0)


def _fronts(ray, name: str) -> dict[str, int]:
    return _actors(ray, name, "-front")


def test_fronts_serve_the_api_apart_from_the_controller_and_the_hosts(cluster, ray_session):
    box, config = cluster
    running = box["running"]
    fronts, hosts = _fronts(ray_session, running.name), _hosts(ray_session, running.name)
    controller_pid = ray_session.get(running.controller.pid.remote())
    assert sorted(fronts) == [f"{running.name}-front0", f"{running.name}-front1"]
    assert len(set(fronts.values()) | set(hosts.values()) | {controller_pid}) == 5
    prompts = [_unrelated(i) for i in range(6)]
    outputs = _generate_all(running.address, prompts)
    assert [o.token_ids for o in outputs] == _reference(config, prompts)
    assert {o.replica for o in outputs} == {f"{running.name}/0", f"{running.name}/1"}


def test_a_sigkilled_front_s_streams_resume_through_the_other_with_equal_tokens(cluster, ray_session):
    box, _ = cluster
    running = box["running"]
    undisturbed = run_streams(running.address)
    victim = _fronts(ray_session, running.name)[f"{running.name}-front1"]
    disturbed = run_streams(running.address, fault=lambda: os.kill(victim, signal.SIGKILL))
    assert disturbed == undisturbed
    wait_for(lambda: _fronts(ray_session, running.name).get(f"{running.name}-front1", victim) != victim,
             "the controller to start front 1 again")
    assert len(_generate_all(running.address, [_unrelated(50 + i) for i in range(4)])) == 4


def test_a_sigkilled_controller_breaks_no_stream_and_a_new_one_adopts_the_cluster(cluster, ray_session, tiny_llama_dir):
    from shardserve.launch.ray_serving import start_cluster

    box, config = cluster
    running = box["running"]
    undisturbed = run_streams(running.address, resume=False)
    controller_pid = ray_session.get(running.controller.pid.remote())
    hosts = _hosts(ray_session, running.name)
    disturbed = run_streams(running.address, fault=lambda: os.kill(controller_pid, signal.SIGKILL), resume=False)
    assert disturbed == undisturbed  # no stream broke: the client did not resume
    # `serve` starts a new controller under the same name: it adopts the hosts (no reload) and the fronts
    port = int(running.address.rsplit(":", 1)[1])
    box["running"] = again = start_cluster(config, host="127.0.0.1", port=port, replicas=2, fronts=2,
                                           routing="round-robin", name=running.name)
    assert again.address == running.address
    assert _hosts(ray_session, running.name) == hosts  # the same processes: nothing loaded again
    assert again.status()["state"] == "serving"
    assert len(_generate_all(again.address, [_unrelated(70 + i) for i in range(4)])) == 4
