"""A lost TP group mid-generation: after Engine.restart over a new executor, every live request finishes with
exactly the tokens of an undisturbed run, none lost or duplicated, and the streams see only a pause.

The fake workers check the delta semantics and the KV per slot at every step, so a request resumed without a token
it had, a block table from the old cache or a step id that does not start again at 1 fails here.
"""

from __future__ import annotations

import pytest
from _fake_executor import FakeExecutor, expected_output
from test_async_engine import OverlappingFake

from shardserve.cluster.engine import Engine
from shardserve.cluster.executor import WorkerError
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig

BS = 4
VOCAB = 1000
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]
PROMPTS = {f"r{i}": PREFIX[: 4 + i % 5] + [100 + i] * (1 + i % 4) for i in range(10)}
MAX_TOKENS = {req_id: 6 + 3 * i for i, req_id in enumerate(PROMPTS)}


def _engine(fake: FakeExecutor, async_on: bool, **config) -> Engine:
    config.setdefault("max_model_len", 256)
    cfg = EngineConfig(model="fake", block_size=BS, async_scheduling=async_on, **config)
    engine = Engine(cfg, fake, vocab_size=VOCAB)
    for req_id, prompt in PROMPTS.items():
        engine.admit(req_id, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[req_id]))
    return engine


def _run_through_failures(engine: Engine, make_fake, max_steps: int = 2000) -> tuple[dict, list]:
    """Steps to the end; on WorkerError restarts over make_fake() (as the controller does). Returns the streamed
    tokens per request (every delta concatenated) and the executors used, in order."""
    streamed: dict[str, list[int]] = {req_id: [] for req_id in PROMPTS}
    executors = [engine.executor]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return streamed, executors
        try:
            deltas = engine.step()
        except WorkerError:
            executors.append(make_fake())
            engine.restart(executors[-1])
            continue
        for delta in deltas:
            assert delta.finish_reason != "abort"
            streamed[delta.request_id] += delta.token_ids
    raise AssertionError("the engine did not finish")


def _expected() -> dict[str, list[int]]:
    return {req_id: expected_output(prompt, MAX_TOKENS[req_id], VOCAB) for req_id, prompt in PROMPTS.items()}


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("fail_at_step", [1, 3, 9])
@pytest.mark.parametrize("after_running", [False, True], ids=["before-running", "tokens-lost"])
@pytest.mark.parametrize("num_blocks", [64, 12], ids=["roomy", "preempting"])
def test_a_lost_group_costs_no_token_and_duplicates_none(async_on, fail_at_step, after_running, num_blocks):
    fake_type = OverlappingFake if async_on else FakeExecutor
    first = fake_type(num_blocks, BS, VOCAB, fail_at_step=fail_at_step, fail_after_running=after_running)
    engine = _engine(first, async_on)
    streamed, executors = _run_through_failures(engine, lambda: fake_type(num_blocks, BS, VOCAB))
    assert len(executors) == 2 and first.failed and engine.num_restarts == 1
    assert streamed == _expected()
    outputs = {o.request_id: o for o in engine.take_finished()}
    assert {req_id: o.outputs[0].token_ids for req_id, o in outputs.items()} == _expected()
    assert all(o.outputs[0].finish_reason == "length" for o in outputs.values())
    assert engine.block_manager.all_free() and engine.scheduler.num_plans_in_flight == 0


def test_the_new_group_gets_every_live_request_in_full_from_step_one():
    first = FakeExecutor(64, BS, VOCAB, fail_at_step=5, fail_after_running=True)
    engine = _engine(first, async_on=False)
    for _ in range(4):
        engine.step()
    known = {req_id: list(seq.token_ids) for req_id, seq in engine.scheduler.requests.items()}
    assert any(len(tokens) > len(PROMPTS[req_id]) for req_id, tokens in known.items())  # some generated already
    with pytest.raises(WorkerError):
        engine.step()
    second = FakeExecutor(64, BS, VOCAB)
    engine.restart(second)
    assert engine.block_manager.num_used_blocks == 0 and engine.block_manager.num_cached_blocks == 0
    engine.step()
    plan = second.plans[0]
    assert plan.step_id == 1 and not plan.finished_req_ids and not plan.preempted_req_ids
    # prompt + generated so far, nothing from the failed step, and no prefix hit in the new (empty) cache
    resent = {new.req_id: new for new in plan.new_requests}
    for req_id, new in resent.items():
        assert new.token_ids == known[req_id] and new.num_computed_tokens == 0
        assert new.num_prompt_tokens == len(PROMPTS[req_id])


def test_requests_admitted_while_the_group_was_lost_run_after_the_resumed_ones():
    first = FakeExecutor(64, BS, VOCAB, fail_at_step=2)
    engine = _engine(first, async_on=False)
    engine.step()
    with pytest.raises(WorkerError):
        engine.step()
    engine.admit("late", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    engine.restart(FakeExecutor(64, BS, VOCAB))
    order = [seq.req_id for seq in engine.scheduler.waiting]
    assert order == [*PROMPTS, "late"]  # arrival order: FCFS survives the restart


def test_a_resumed_request_generates_the_rest_of_the_unbroken_one_and_streams_only_that():
    """A client resubmits prompt + the tokens it received (resumed=...): they count as generated, not prompt,
    and are not streamed again; the rest equals the unbroken request's."""
    prompt, n = PROMPTS["r3"], 12
    whole = expected_output(prompt, n, VOCAB)
    engine = Engine(EngineConfig(model="fake", block_size=BS, max_model_len=256), FakeExecutor(64, BS, VOCAB),
                    vocab_size=VOCAB)
    engine.admit("again", prompt, SamplingParams(temperature=0, max_tokens=n), resumed=whole[:5])
    streamed = []
    while engine.has_unfinished():
        for delta in engine.step():
            streamed += delta.token_ids
            final = delta
    assert streamed == whole[5:]
    assert final.finish_reason == "length" and final.num_generated == n and final.num_prompt_tokens == len(prompt)
    new = engine.executor.plans[0].new_requests[0]
    assert new.token_ids == prompt + whole[:5] and new.num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("resumed, why", [([1] * 12, "leave nothing"), ([VOCAB], "resumed token ids")])
def test_resumed_tokens_that_cannot_be_are_refused(resumed, why):
    engine = Engine(EngineConfig(model="fake", block_size=BS, max_model_len=256), FakeExecutor(64, BS, VOCAB),
                    vocab_size=VOCAB)
    with pytest.raises(ValueError, match=why):
        engine.admit("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12), resumed=resumed)


def test_a_request_the_smaller_cache_of_the_new_group_cannot_hold_ends_with_the_reason_and_the_others_finish():
    """A group that comes back with fewer KV blocks: a live request that needs more than the new cache holds would
    wait forever (or fail the loop); it ends at the restart with an error delta, and the rest go on."""
    first = FakeExecutor(64, BS, VOCAB, fail_at_step=3)
    engine = Engine(EngineConfig(model="fake", block_size=BS, max_model_len=256), first, vocab_size=VOCAB)
    engine.admit("big", [1] * 8, SamplingParams(temperature=0, max_tokens=100))  # 27 blocks of 4
    engine.admit("small", [2, 3, 4], SamplingParams(temperature=0, max_tokens=6))
    with pytest.raises(WorkerError):
        for _ in range(3):
            engine.step()
    engine.restart(FakeExecutor(16, BS, VOCAB))
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        finals.update({d.request_id: d for d in engine.step() if d.finished})
    assert set(finals) == {"big", "small"}
    assert finals["big"].finish_reason == "abort" and "holds 16 blocks" in finals["big"].error
    assert "needs 27" in finals["big"].error
    assert finals["small"].error is None and finals["small"].finish_reason == "length"
    assert engine.block_manager.all_free()


def test_the_routers_prefix_index_hears_of_the_blocks_a_restarted_group_stores():
    """A server replica hands each step's block events to the router (cluster/router.py), which forgets the
    replica's entries when its group is lost (as the controller does). The new group recomputes the live request's
    prompt in its first step: the router must hear of those blocks, or prompts sharing them are no longer sent
    where they are cached."""
    import asyncio

    from shardserve.cluster.local_replica import LocalReplica
    from shardserve.cluster.replica import ReplicaState
    from shardserve.cluster.router import Router, prompt_block_hashes

    prompt = list(range(1, 14))  # three full blocks of 4, and one token
    groups = []

    def build(config: EngineConfig) -> Engine:  # the first group fails in its third step
        groups.append(FakeExecutor(64, BS, VOCAB, fail_at_step=3 if not groups else None))
        return Engine(config, groups[-1], vocab_size=VOCAB)

    async def serve() -> int:
        finished = asyncio.Event()

        def on_step(_, report) -> None:
            router.apply_events(0, report.block_events)
            if any(d.finished for d in report.deltas):
                finished.set()

        def on_state(r) -> None:
            if r.state is ReplicaState.RECOVERING:
                router.forget(0)

        replica = LocalReplica("r0", EngineConfig(model="fake", block_size=BS, max_model_len=256), build, on_step,
                               lambda r, e: None, restart_tries=1, restart_backoff_s=0.0, on_state=on_state)
        router = Router([replica])
        await replica.start()
        try:
            await replica.admit("r", prompt, SamplingParams(temperature=0, max_tokens=8))
            await asyncio.wait_for(finished.wait(), 30)
            assert len(groups) == 2 and groups[0].failed and replica.num_restarts == 1
            return router.route(prompt_block_hashes(prompt, BS))[1]
        finally:
            await replica.stop()

    assert asyncio.run(serve()) == 3, "the router's index lost the prompt's blocks after the restart"
