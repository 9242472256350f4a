"""The worker half of the cluster on a real Ray (loopback) with real gRPC: a TP=2 group of Ray actors driven by
GrpcExecutor gives TP=1's tokens, refuses stale step ids, shares one placement group and leaves nothing behind."""

from __future__ import annotations

import time

import pytest

from shardserve.cluster.engine import Engine
from shardserve.cluster.executor import GrpcExecutor, WorkerError
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.launch.placement import launch_worker_group
from shardserve.proto import worker_pb2 as pb
from shardserve.proto import worker_pb2_grpc as pb_grpc
from shardserve.proto.convert import step_plan_to_proto
from shardserve.proto.plan import StepPlan
from shardserve.proto.transport import worker_channel
from shardserve.worker.inprocess import InProcessExecutor
from shardserve.worker.worker_service import serve_worker
from tests.hf_reference import assert_greedy_match, hf_greedy

VOCAB = 384  # make_tiny_model's default
PROMPTS = [[1, 17, 42, 99, 7, 250, 3], [1, 300, 12, 12, 81, 64, 5, 9, 200, 11, 45, 66, 70, 18, 2, 77, 101, 33]]
NUM_NEW = 12
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=2024, max_tokens=NUM_NEW, ignore_eos=True)


def _generate(engine: Engine) -> dict[str, object]:
    """Greedy requests g0, g1 (with each chosen token's logprob) and a seeded one s (same prompt as g1), stepped to
    completion: request id -> its CompletionOutput."""
    for i, prompt in enumerate(PROMPTS):
        engine.admit(f"g{i}", prompt,
                     SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0))
    engine.admit("s", PROMPTS[1], SEEDED)
    while engine.has_unfinished():
        engine.step()
    return {out.request_id: out.outputs[0] for out in engine.take_finished()}


@pytest.fixture(scope="module")
def tp2(ray_session, tiny_llama_dir, e2e_config):
    """A TP=2 worker group on Ray actors and its GrpcExecutor."""
    config = e2e_config(tiny_llama_dir, tensor_parallel_size=2)
    group = launch_worker_group(config, name_prefix="test-workers-tp2")
    try:
        executor = GrpcExecutor(config, group.endpoints, group.init_method, deadline=StepDeadline(floor_s=60.0),
                                secret=group.secret)
    except BaseException:
        group.shutdown()
        raise
    yield config, group, executor
    executor.shutdown()
    group.shutdown()


def test_tp2_over_grpc_matches_tp1_greedy_and_seeded(tp2, tiny_llama_dir, e2e_config):
    config, _, executor = tp2
    cluster = _generate(Engine(config, executor, vocab_size=VOCAB))
    single_executor = InProcessExecutor(e2e_config(tiny_llama_dir))
    single = _generate(Engine(single_executor.config, single_executor, vocab_size=VOCAB))
    single_executor.shutdown()
    for i, ref in enumerate(hf_greedy(tiny_llama_dir, PROMPTS, NUM_NEW)):
        for run in (single, cluster):
            assert_greedy_match(run[f"g{i}"].token_ids, ref, logprobs=run[f"g{i}"].logprobs)
    assert len(cluster["s"].token_ids) == NUM_NEW
    assert cluster["s"].token_ids == single["s"].token_ids  # the same seed gives the same tokens at TP=2 as at TP=1
    assert all(h.ready for h in executor.health())


def test_stale_or_out_of_order_step_is_refused_and_not_applied(tp2):
    config, group, executor = tp2
    executor.execute(StepPlan(step_id=_next_step_id(executor)))  # an empty step: the group is in sync
    last = executor.health()[0].last_step_id
    channel = worker_channel(group.endpoints[0], group.secret)
    try:
        stream = pb_grpc.WorkerStub(channel).Step(
            iter([step_plan_to_proto(StepPlan(step_id=last)), step_plan_to_proto(StepPlan(step_id=last + 2))]),
            timeout=30,
        )
        replies = list(stream)
    finally:
        channel.close()
    assert [r.step_id for r in replies] == [last, last + 2]
    assert "stale or out of order" in replies[0].error and "stale or out of order" in replies[1].error
    health = executor.health()
    assert [h.last_step_id for h in health] == [last, last]  # neither plan was applied on rank 0
    assert [h.state for h in health] == ["READY", "READY"]  # a refusal does not break the worker
    # The executor's own next plan (last + 1) is still the one rank 0 expects.
    assert executor.execute(StepPlan(step_id=last + 1)).step_id == last + 1


@pytest.fixture
def local_worker(tiny_llama_dir, e2e_config):
    """A TP=1 Worker server in this process (no Ray) and its GrpcExecutor: for the executor's error paths."""
    server, address = serve_worker("127.0.0.1", 0, secret="test-secret")
    executor = GrpcExecutor(e2e_config(tiny_llama_dir), [address], "tcp://127.0.0.1:0", deadline=StepDeadline(floor_s=60.0),
                            secret="test-secret")
    yield executor
    executor.shutdown()
    server.stop(grace=None)


def test_a_refused_plan_raises_worker_error_and_the_executor_stays_failed(local_worker):
    with pytest.raises(WorkerError, match=r"refuses step 5: expected step 1"):
        local_worker.execute(StepPlan(step_id=5))
    with pytest.raises(WorkerError, match="failed earlier"):
        local_worker.execute(StepPlan(step_id=1))
    assert local_worker.health()[0].state == "READY"  # the worker itself refused the plan and is fine


def test_an_exception_in_a_step_fails_the_worker_with_its_traceback(local_worker):
    with pytest.raises(WorkerError, match=r"(?s)rank 0 failed in step 1:.*Traceback.*KeyError.*ghost"):
        local_worker.execute(StepPlan(step_id=1, req_ids=["ghost"], num_tokens=[1]))
    (health,) = local_worker.health()
    assert health.state == "FAILED" and "KeyError" in health.error and health.last_step_id == 0


def test_tp_group_actors_share_one_placement_group(tp2, ray_session):
    _, group, _ = tp2
    ray = ray_session
    pg_ids = ray.get([actor.placement_group_id.remote() for actor in group.actors])
    assert pg_ids == [group.placement_group.id.hex()] * 2
    table = ray.util.placement_group_table(group.placement_group)
    assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
    assert len(set(table["bundles_to_node_id"].values())) == 1


def test_group_shutdown_leaves_no_actor_placement_group_or_process(ray_session, tiny_llama_dir, e2e_config):
    import psutil

    ray = ray_session
    group = launch_worker_group(e2e_config(tiny_llama_dir, tensor_parallel_size=2), name_prefix="test-workers-shutdown")
    pids = ray.get([actor.pid.remote() for actor in group.actors])
    assert all(psutil.pid_exists(pid) for pid in pids)
    group.shutdown()
    assert ray.util.placement_group_table(group.placement_group)["state"] == "REMOVED"
    for actor in group.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the process table, bounded by the deadline
    assert not any(_alive(pid) for pid in pids)
    named = {a["Name"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"}
    assert not any(name.startswith("test-workers-shutdown") for name in named)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _next_step_id(executor: GrpcExecutor) -> int:
    return max(h.last_step_id for h in executor.health()) + 1
