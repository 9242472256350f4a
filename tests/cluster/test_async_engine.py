"""Async scheduling at the engine level with the scripted fake workers: the same outputs as without overlap.

The fake runs each plan when it is submitted and keeps the result until collect(), so the engine really plans
step N+1 before it has seen result N. It checks the delta semantics and the KV it holds per slot at every step,
so a block handed out while a plan still needed it, or a resumed request missing a token, fails here.
"""

from __future__ import annotations

from collections import deque

import pytest
from _fake_executor import FakeExecutor, expected_output
from _tiny_tokenizer import byte_level_bpe

from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.scheduler import Scheduler
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult
from tests.engine_driver import drive

BS = 4
VOCAB = 1000
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]
PROMPTS = {f"r{i}": PREFIX[: 4 + i % 5] + [100 + i] * (1 + i % 4) for i in range(10)}


class OverlappingFake(FakeExecutor):
    """FakeExecutor with submit/collect: results wait in a queue; records how many were ever uncollected."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.results: deque[StepResult] = deque()
        self.max_uncollected = 0

    def submit(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.history.pop(req_id, None)  # a finished id may come back as a new request
        self.results.append(self.execute(plan))
        self.max_uncollected = max(self.max_uncollected, len(self.results))

    def collect(self) -> StepResult:
        return self.results.popleft()


def make_engine(async_on: bool, num_blocks=64, tokenizer=None, eos=(), vocab=VOCAB, **config) -> Engine:
    config.setdefault("max_model_len", 256)
    cfg = EngineConfig(model="fake", block_size=BS, async_scheduling=async_on, **config)
    return Engine(cfg, OverlappingFake(num_blocks, BS, vocab), tokenizer, eos, vocab_size=vocab)


def run(engine: Engine, abort_after: dict[str, int] | None = None, max_steps=2000) -> dict:
    """Steps until done, aborting abort_after's requests once they have that many tokens; final outputs by id."""
    drive(engine, abort_after, max_steps)
    assert engine.block_manager.all_free()
    assert engine.scheduler.num_plans_in_flight == 0
    return {o.request_id: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in engine.take_finished()}


SETTINGS = [
    dict(),
    dict(max_num_batched_tokens=5),
    dict(num_blocks=8),
    dict(num_blocks=8, max_num_batched_tokens=3, max_num_seqs=3),
]
SETTING_IDS = ["default", "tiny-budget", "few-blocks", "few-blocks-tiny-budget"]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_overlapped_outputs_equal_sequential_with_stops_lengths_and_aborts(setting):
    outputs = {}
    for async_on in (False, True):
        engine = make_engine(async_on, eos=[3], **setting)
        for i, (req_id, prompt) in enumerate(PROMPTS.items()):
            stop = [expected_output(prompt, 6, VOCAB)[2 + i % 3]] if i % 3 == 0 else []  # a stop id mid-output
            engine.admit(req_id, prompt, SamplingParams(temperature=0, max_tokens=4 + i, stop_token_ids=stop))
        outputs[async_on] = run(engine, abort_after={"r4": 2, "r7": 4})
        assert engine.async_scheduling is async_on
        assert engine.executor.max_uncollected == (2 if async_on else 0)  # sync mode calls execute()
    assert outputs[True] == outputs[False]
    reasons = {reason for _, reason, _ in outputs[True].values()}
    assert reasons == {"stop", "length", "abort"}


def test_overlapped_stop_strings_and_min_tokens_match_sequential():
    tok = byte_level_bpe()
    outputs = {}
    for async_on in (False, True):
        engine = make_engine(async_on, tokenizer=tok, vocab=tok.get_vocab_size(), max_num_batched_tokens=6)
        for i, req_id in enumerate(["a", "b", "c"]):
            prompt = tok.encode("hello world, the quick").ids[i : 3 + 2 * i]
            text = tok.decode(expected_output(prompt, 8, tok.get_vocab_size()))
            params = SamplingParams(temperature=0, max_tokens=8, stop=[text[3:5]] if i != 1 else [], min_tokens=2 * i)
            engine.admit(req_id, prompt, params)
        outputs[async_on] = run(engine)
    assert outputs[True] == outputs[False]
    assert any(reason == "stop" for _, reason, _ in outputs[True].values())


def test_preempting_a_request_whose_token_is_in_flight_keeps_its_output(monkeypatch):
    in_flight_at_preemption = []
    original = Scheduler._preempt

    def spy(self, seq):
        in_flight_at_preemption.append(seq.num_pending_tokens)
        original(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    engine = make_engine(True, num_blocks=6)
    for req_id, prompt in list(PROMPTS.items())[:5]:
        engine.admit(req_id, prompt, SamplingParams(temperature=0, max_tokens=9))
    outputs = run(engine)
    assert any(n > 0 for n in in_flight_at_preemption), "no preemption hit a request with a token in flight"
    for req_id, prompt in list(PROMPTS.items())[:5]:
        assert outputs[req_id] == (expected_output(prompt, 9, VOCAB), "length", "")


def test_finished_request_keeps_its_blocks_until_its_last_plan_is_applied():
    engine = make_engine(True)
    prompt = PROMPTS["r0"]
    stop = expected_output(prompt, 3, VOCAB)[1]  # the second token stops it
    engine.admit("x", prompt, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[stop]))
    finished_while_planned = False
    while engine.has_unfinished():
        deltas = engine.step()
        if any(d.finished for d in deltas):
            # A plan computing x (its wasted step) is still in flight: x's blocks must not be free yet.
            finished_while_planned = engine.scheduler.num_plans_in_flight > 0
            assert finished_while_planned and engine.block_manager.num_used_blocks > 0
    assert finished_while_planned
    assert engine.block_manager.all_free()
    assert engine.take_finished()[0].outputs[0].token_ids == expected_output(prompt, 2, VOCAB)


def test_a_reused_id_does_not_get_the_previous_requests_late_token():
    engine = make_engine(True)
    first, second = PROMPTS["r1"], PROMPTS["r8"]
    stop = expected_output(first, 3, VOCAB)[0]
    engine.admit("x", first, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))
    while True:
        if any(d.finished for d in engine.step()):
            break
    assert engine.pop_output("x").outputs[0].token_ids == [stop]
    assert engine.scheduler.num_plans_in_flight > 0  # the first x's extra token is still to come back
    engine.admit("x", second, SamplingParams(temperature=0, max_tokens=5))
    assert run(engine)["x"][0] == expected_output(second, 5, VOCAB)


def test_explicit_async_scheduling_needs_submit_and_collect():
    cfg = EngineConfig(model="fake", block_size=BS, async_scheduling=True)
    with pytest.raises(ValueError, match="submit/collect"):
        Engine(cfg, FakeExecutor(8, BS, VOCAB), vocab_size=VOCAB)
    cuda = EngineConfig(model="fake", block_size=BS, device="cuda")
    auto = Engine(cuda, FakeExecutor(8, BS, VOCAB), vocab_size=VOCAB)
    assert not auto.async_scheduling  # the default falls back to one step at a time
