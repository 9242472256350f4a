"""Strangers cannot drive the workers: a TP=2 cluster of Ray actors (tiny model, loopback) refuses an anonymous
Shutdown and an anonymous StepPlan carrying the next step id with UNAUTHENTICATED, is unharmed by them (the next
real request gives the reference tokens), and none of its workers' sockets listens on every interface."""

from __future__ import annotations

import grpc
import pytest

from shardserve.client.clients import Client
from shardserve.proto import worker_pb2 as pb
from shardserve.proto import worker_pb2_grpc as pb_grpc
from shardserve.proto.auth import WORKER_SECRET_KEY
from shardserve.proto.convert import step_plan_to_proto
from shardserve.proto.plan import StepPlan
from shardserve.proto.transport import worker_channel
from tests.hf_reference import assert_greedy_match, hf_greedy

PROMPT = [1, 17, 42, 99, 7, 250, 3]
NUM_NEW = 10


@pytest.fixture(scope="module")
def tp2_cluster(ray_session, tiny_llama_dir, e2e_config):
    from shardserve.launch.ray_serving import start_cluster

    running = start_cluster(e2e_config(tiny_llama_dir, tensor_parallel_size=2), host="127.0.0.1", port=0)
    yield running
    running.shutdown(drain_timeout_s=0)


def _group(cluster):
    """The cluster's one TP group (the controller actor starts and owns it)."""
    (group,) = cluster.worker_groups()
    return group


def _greedy(cluster) -> list[int]:
    with Client(cluster.address, timeout=120) as client:
        return client.generate(PROMPT, max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True).token_ids


def _last_step_ids(cluster) -> list[int]:
    """What the controller sees (the test may ask with the secret; the attacker is assumed to guess it right)."""
    ids = []
    for endpoint in _group(cluster).endpoints:
        channel = worker_channel(endpoint, _group(cluster).secret)
        try:
            health = pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=30)
        finally:
            channel.close()
        assert health.state == pb.WORKER_STATE_READY, health.error
        ids.append(health.last_step_id)
    return ids


@pytest.mark.parametrize("metadata", [None, ((WORKER_SECRET_KEY, "a-guess"),)], ids=["anonymous", "wrong-secret"])
def test_shutdown_and_next_step_from_a_stranger_are_unauthenticated_and_harmless(tp2_cluster, tiny_llama_dir,
                                                                                  metadata):
    reference = hf_greedy(tiny_llama_dir, [PROMPT], NUM_NEW)[0]
    assert_greedy_match(_greedy(tp2_cluster), reference)  # the cluster serves before the attack
    next_step = max(_last_step_ids(tp2_cluster)) + 1
    for endpoint in _group(tp2_cluster).endpoints:
        with grpc.insecure_channel(endpoint) as channel:
            stub = pb_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as shutdown:
                stub.Shutdown(pb.ShutdownRequest(), timeout=30, metadata=metadata)
            assert shutdown.value.code() == grpc.StatusCode.UNAUTHENTICATED
            plans = iter([step_plan_to_proto(StepPlan(step_id=next_step))])
            with pytest.raises(grpc.RpcError) as step:
                list(stub.Step(plans, timeout=30, metadata=metadata))
            assert step.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as health:
                stub.Health(pb.HealthRequest(), timeout=30, metadata=metadata)
            assert health.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert max(_last_step_ids(tp2_cluster)) == next_step - 1  # no rank applied the stranger's plan
    assert_greedy_match(_greedy(tp2_cluster), reference)  # and the next real request is served correctly
    assert tp2_cluster.status()["state"] == "serving"


def test_no_worker_socket_listens_on_every_interface(tp2_cluster, ray_session):
    """Every listener of the workers' processes (the Worker gRPC servers, rank 0's torch.distributed store,
    gloo's sockets, and Ray's own core-worker servers, which Ray binds to the node's address) is on loopback."""
    import psutil

    ray = ray_session
    pids = ray.get([actor.pid.remote() for actor in _group(tp2_cluster).actors])
    store_port = int(_group(tp2_cluster).init_method.rsplit(":", 1)[1])
    ours = {int(ep.rsplit(":", 1)[1]) for ep in _group(tp2_cluster).endpoints} | {store_port}
    listening = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append((pid, conn.laddr.ip, conn.laddr.port))
    assert ours <= {port for _, _, port in listening}
    wildcard = [entry for entry in listening if entry[1] in ("0.0.0.0", "::")]
    assert not wildcard, f"listening on every interface: {wildcard}"
