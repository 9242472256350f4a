"""The scheduler with pipeline stages: plans in flight on disjoint requests, and the sampled tokens that the stages
before the last (which do not sample) receive in each plan.

A stand-in for such a stage keeps every request's token list from the plans alone (new requests' tokens, then
`sampled_token_ids`) and must hold exactly the controller's tokens whenever a plan computes them."""

from __future__ import annotations

from collections import deque

from _fake_executor import FakeExecutor, expected_output

from shardserve.cluster.block_manager import BlockManager
from shardserve.cluster.request import Request
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.scheduler import Scheduler
from shardserve.proto.config import EngineConfig

BS = 4
VOCAB = 1000


class EarlyStage:
    """What a stage before the last knows: token lists built from the plans only."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def apply(self, plan) -> None:
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self.tokens.pop(req_id, None)
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for req_id, token in zip(plan.req_ids, plan.sampled_token_ids):
            if token >= 0:
                self.tokens[req_id].append(token)
        for req_id, n in zip(plan.req_ids, plan.num_tokens):
            end = self.computed[req_id] + n
            assert end <= len(self.tokens[req_id]), f"step {plan.step_id}: {req_id} computes a token it lacks"
            self.computed[req_id] = end


def run_pipelined(num_blocks: int, prompts: dict[str, list[int]], max_tokens: int, pp: int = 2, **config):
    config.setdefault("max_model_len", 256)
    cfg = EngineConfig(model="fake", block_size=BS, pipeline_parallel_size=pp, **config)
    bm = BlockManager(num_blocks, BS, True)
    sched = Scheduler(cfg, bm)
    ex = FakeExecutor(num_blocks, BS, VOCAB)
    stage = EarlyStage()
    seqs = {}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        seqs[req_id] = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), arrival=i)
        sched.add(seqs[req_id])
    in_flight: deque = deque()
    max_overlap = 0
    for _ in range(2000):
        if not sched.has_unfinished() and not in_flight:
            break
        plan = sched.schedule() if len(in_flight) < pp else None
        if plan is not None:
            busy = {r for p, _ in in_flight for r in p.req_ids}
            assert not busy & set(plan.req_ids), f"step {plan.step_id} repeats requests in flight"
            assert len(plan.req_ids) <= -(-len(sched.requests) // pp)
            assert len(plan.sampled_token_ids) == len(plan.req_ids)
            stage.apply(plan)
            for req_id, n in zip(plan.req_ids, plan.num_tokens):  # the stage's tokens are the controller's
                seq = seqs[req_id]
                assert stage.tokens[req_id] == seq.token_ids, f"step {plan.step_id}: {req_id}'s tokens differ"
            in_flight.append((plan, ex.execute(plan)))
            max_overlap = max(max_overlap, len(in_flight))
        if in_flight and (plan is None or len(in_flight) == pp):
            done, result = in_flight.popleft()
            for seq in sched.update(done, result):
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq, "length")
    else:
        raise AssertionError("did not finish")
    for req_id, seq in seqs.items():
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, max_tokens, VOCAB), req_id
    assert bm.all_free()
    return sched, max_overlap


def prompts_of(count: int, length: int) -> dict[str, list[int]]:
    return {f"r{i}": [(i * 31 + j * 7) % VOCAB for j in range(length + i)] for i in range(count)}


def test_two_stages_keep_two_plans_in_flight_on_disjoint_requests():
    sched, overlap = run_pipelined(64, prompts_of(6, 9), max_tokens=12, max_num_seqs=6)
    assert overlap == 2


def test_three_stages_with_chunked_prefill_and_preemption_keep_early_stage_tokens_exact():
    sched, overlap = run_pipelined(14, prompts_of(6, 11), max_tokens=16, pp=3, max_num_batched_tokens=10,
                                   max_num_seqs=6)
    assert overlap == 3
    assert sched.num_preemptions > 0


def test_without_pipeline_stages_plans_carry_no_sampled_tokens():
    cfg = EngineConfig(model="fake", block_size=BS, max_model_len=64)
    sched = Scheduler(cfg, BlockManager(16, BS, True))
    sched.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), arrival=0))
    plan = sched.schedule()
    assert plan.sampled_token_ids == []


def test_the_live_requests_split_into_one_batch_per_stage_unless_plans_run_one_at_a_time():
    def first_plans(num_batches):
        cfg = EngineConfig(model="fake", block_size=BS, max_model_len=64, pipeline_parallel_size=2)
        sched = Scheduler(cfg, BlockManager(64, BS, True))
        if num_batches is not None:
            sched.num_batches = num_batches
        for i in range(5):
            sched.add(Request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=4, temperature=0), arrival=i))
        return sched.schedule(), sched.schedule()

    first, second = first_plans(None)
    assert (first.req_ids, second.req_ids) == (["r0", "r1", "r2"], ["r3", "r4"])
    first, second = first_plans(1)
    assert first.req_ids == ["r0", "r1", "r2", "r3", "r4"] and second is None
