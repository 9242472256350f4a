import pytest
from _fake_executor import FakeExecutor, expected_output

from shardserve.cluster.admission import RequestLimits, check_request
from shardserve.cluster.block_manager import BlockManager
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.scheduler import Scheduler
from shardserve.cluster.request import RequestStatus, Request
from shardserve.proto.config import EngineConfig

BS = 4
VOCAB = 1000


class Harness:
    """Scheduler + fake workers; finishes requests at max_tokens like the engine does."""

    def __init__(self, num_blocks=64, prefix_caching=True, **config):
        config.setdefault("max_model_len", 512)
        self.config = EngineConfig(model="fake", block_size=BS, enable_prefix_caching=prefix_caching, **config)
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.config, self.bm)
        self.ex = FakeExecutor(num_blocks, BS, VOCAB)
        self.seqs: dict[str, Request] = {}
        self.finish_order: list[str] = []
        self._arrival = 0

    def add(self, req_id, prompt, max_tokens=4):
        """Admits a request as Engine.admit does: checked first, then queued."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        check_request(list(prompt), params, RequestLimits(VOCAB, self.config.max_model_len, BS, self.bm.num_blocks))
        seq = Request(req_id, list(prompt), params, arrival=self._arrival)
        self._arrival += 1
        self.sched.add(seq)
        self.seqs[req_id] = seq
        return seq

    def step(self):
        plan = self.sched.schedule()
        if plan is None:
            return None
        for seq in self.sched.update(plan, self.ex.execute(plan)):
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
                self.finish_order.append(seq.req_id)
        return plan

    def run(self, max_steps=500):
        plans = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return plans
            plan = self.step()
            assert plan is not None, "no progress"
            plans.append(plan)
        raise AssertionError("did not finish")

    def assert_outputs_exact(self):
        for req_id, seq in self.seqs.items():
            assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.params.max_tokens, VOCAB), req_id


def test_token_budget_and_max_num_seqs_bound_every_step():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=6)
    for i in range(5):
        h.add(f"r{i}", [10 + i] * 5, max_tokens=3)
    plans = h.run()
    assert plans[0].req_ids == ["r0", "r1"] and plans[0].num_tokens == [5, 1]  # r1 gets a chunk of the budget
    assert all(p.num_batched_tokens <= 6 for p in plans)
    assert all(len(p.req_ids) <= 2 for p in plans)
    h.assert_outputs_exact()
    assert h.bm.all_free()


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    h = Harness(max_num_batched_tokens=8)
    h.add("short", [1, 2, 3], max_tokens=6)
    h.step()
    h.add("long", list(range(100, 120)), max_tokens=2)
    p2, p3, p4 = h.step(), h.step(), h.step()
    assert (p2.req_ids, p2.num_tokens) == (["short", "long"], [1, 7])
    assert (p3.req_ids, p3.num_tokens) == (["short", "long"], [1, 7])
    assert (p4.req_ids, p4.num_tokens) == (["short", "long"], [1, 6])
    assert [n.req_id for n in p2.new_requests] == ["long"] and not p3.new_requests
    assert "long" in p3.new_block_ids  # the chunk crossed into new blocks: only those are sent
    assert len(h.seqs["long"].output_token_ids) == 1  # sampled only after the last chunk
    h.run()
    h.assert_outputs_exact()
    assert h.bm.all_free()


def test_waiting_requests_are_served_first_come_first_served():
    h = Harness(max_num_seqs=1)
    for name in ["c", "a", "d", "b"]:
        h.add(name, [7, 8, 9], max_tokens=2)
    h.run()
    assert h.finish_order == ["c", "a", "d", "b"]


def test_preemption_takes_the_latest_arrival_and_resends_all_its_tokens():
    h = Harness(num_blocks=6, prefix_caching=False)
    for name in ["a", "b", "c"]:
        h.add(name, [ord(name)] * 7, max_tokens=8)  # 2 blocks each: the cache is full after admission
    h.step()  # prefill: positions 0-6
    h.step()  # decode position 7: still in block 2
    plan = h.step()  # position 8 needs a third block each: c (latest) is preempted for a, then b
    assert h.seqs["c"].status is RequestStatus.PREEMPTED and h.sched.waiting[0] is h.seqs["c"]
    assert plan.req_ids == ["a", "b"]
    assert plan.preempted_req_ids == ["c"]  # the workers drop it before running this very step
    assert h.ex.dropped_preempted == ["c"] and "c" not in h.ex.requests
    c_before = list(h.seqs["c"].token_ids)
    plans = h.run()
    resumed = [n for p in plans for n in p.new_requests if n.req_id == "c"]
    assert len(resumed) == 1 and resumed[0].token_ids == c_before and len(c_before) == 9
    assert resumed[0].num_computed_tokens == 0  # recomputed in full
    h.assert_outputs_exact()
    assert h.bm.all_free() and h.sched.num_preemptions >= 1


def test_recompute_after_preemption_reuses_its_own_cached_blocks():
    h = Harness(num_blocks=7, prefix_caching=True)
    for name in ["a", "b", "c"]:
        h.add(name, [ord(name)] * 7, max_tokens=4)  # 2 blocks each, one spare
    plans = h.run()
    # step 3: a takes the spare block, b preempts c and takes c's freed tail block; c's head stays cached
    assert plans[2].req_ids == ["a", "b"] and h.sched.num_preemptions == 1
    resumed = [n for p in plans for n in p.new_requests if n.req_id == "c" and p.step_id > 1]
    assert len(resumed) == 1 and len(resumed[0].token_ids) == 9
    assert resumed[0].num_computed_tokens == BS  # its first block survived in the prefix cache
    h.assert_outputs_exact()
    assert h.bm.all_free()


def test_request_that_can_never_fit_is_rejected_at_admission():
    h = Harness(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add("too-long", [1] * 30, max_tokens=3)
    with pytest.raises(ValueError, match="KV blocks"):
        h.add("too-big", [1] * 14, max_tokens=4)  # 17 stored positions need 5 blocks of 4; 4 exist
    h.add("fits", [1] * 13, max_tokens=4)  # 16 stored positions: exactly 4 blocks
    assert [s.req_id for s in h.sched.waiting] == ["fits"]  # the rejected ones left no trace
    h.run()
    assert h.bm.all_free()


def test_step_ids_count_plans_and_an_idle_schedule_consumes_nothing():
    h = Harness()
    assert h.sched.schedule() is None and h.sched.step_id == 0
    h.add("a", [1, 2], max_tokens=3)
    plans = h.run()
    assert [p.step_id for p in plans] == [1, 2, 3]
    assert h.sched.schedule() is None and h.sched.step_id == 3


def test_finished_ids_reach_the_workers_only_for_requests_they_hold():
    h = Harness(max_num_seqs=1)
    h.add("a", [1, 2], max_tokens=1)
    h.add("never-sent", [3, 4], max_tokens=1)
    h.step()  # a prefills, samples its only token, finishes
    h.sched.finish(h.seqs["never-sent"], "abort")
    h.add("b", [5], max_tokens=1)
    plan = h.step()
    assert plan.finished_req_ids == ["a"] and "a" not in h.ex.requests
    h.step()
    assert h.ex.dropped_finished == ["a"]  # b's drop is still pending: there was no later plan
    assert h.bm.all_free()


def test_prefix_hit_skips_the_cached_blocks():
    h = Harness()
    h.add("a", list(range(12)), max_tokens=2)
    h.run()
    h.add("b", list(range(8)) + [50, 51, 52], max_tokens=2)
    plan = h.step()
    assert plan.new_requests[0].num_computed_tokens == 8 and plan.num_tokens == [3]
    assert h.seqs["b"].num_cached_tokens == 8
    h.run()
    h.assert_outputs_exact()


def test_planning_a_step_ahead_discards_the_token_after_a_late_stop():
    h = Harness()
    a = h.add("a", [1, 2, 3], max_tokens=10)
    plan1 = h.sched.schedule()
    result1 = h.ex.execute(plan1)
    plan2 = h.sched.schedule()  # before step 1's token is known: decode the pending token
    assert plan2.req_ids == ["a"] and plan2.num_tokens == [1]
    result2 = h.ex.execute(plan2)
    assert h.sched.update(plan1, result1) == [a]
    h.sched.finish(a, "stop")  # e.g. its first token was a stop token
    assert h.sched.update(plan2, result2) == []  # the extra token is dropped
    assert a.output_token_ids == expected_output([1, 2, 3], 1, VOCAB)
    assert h.bm.all_free()


def test_planning_ahead_never_schedules_past_max_tokens():
    h = Harness()
    h.add("b", [1, 2, 3], max_tokens=2)
    plan1 = h.sched.schedule()
    r1 = h.ex.execute(plan1)
    plan2 = h.sched.schedule()
    r2 = h.ex.execute(plan2)
    assert h.sched.schedule() is None  # two tokens are already on their way
    h.sched.update(plan1, r1)
    h.sched.update(plan2, r2)
    assert h.seqs["b"].output_token_ids == expected_output([1, 2, 3], 2, VOCAB)


def test_blocks_become_findable_only_once_their_kv_is_computed():
    h = Harness(max_num_batched_tokens=7)
    h.add("a", list(range(11)), max_tokens=2)
    h.step()  # a's first chunk: positions 0-6, so block 1 (positions 4-7) is not complete yet
    h.add("b", list(range(8)) + [90, 91], max_tokens=2)
    plan = h.step()  # b's first block is cached, its second is still a's to compute: b waits for it
    assert plan.req_ids == ["a"] and h.sched.waiting[0] is h.seqs["b"]
    plan = h.step()
    assert plan.req_ids == ["a", "b"] and plan.new_requests[0].num_computed_tokens == 8
    h.run()
    h.assert_outputs_exact()
    assert h.bm.all_free()


def test_a_request_waits_for_the_prefix_a_running_request_is_computing():
    """Three requests arrive together: b shares a's 12-token prompt prefix, c shares nothing. b waits (c goes
    ahead of it) while a computes the shared blocks, then is admitted with them from the prefix cache instead of
    computing them again; every output is still exact."""
    h = Harness()
    h.add("a", list(range(13)), max_tokens=3)
    h.add("b", list(range(12)) + [70, 71, 72], max_tokens=3)
    h.add("c", [500 + i for i in range(9)], max_tokens=3)
    first = h.step()
    assert first.req_ids == ["a", "c"] and h.sched.waiting[0] is h.seqs["b"]
    assert h.sched.num_prefix_waits == 1
    second = h.step()
    b = next(r for r in second.new_requests if r.req_id == "b")
    assert b.num_computed_tokens == 12 and second.num_tokens[second.req_ids.index("b")] == 3
    assert h.seqs["b"].num_cached_tokens == 12
    h.run()
    h.assert_outputs_exact()
    assert h.bm.all_free()


def test_identical_prompts_compute_their_prefix_once_even_when_chunked():
    """n copies of one prompt (what n outputs of a prompt send), the prompt longer than a step's budget: the
    copies wait while the first computes it chunk by chunk, then each computes only its last partial block."""
    h = Harness(max_num_batched_tokens=8)
    prompt = list(range(30))
    for i in range(3):
        h.add(f"n{i}", prompt, max_tokens=2)
    plans = h.run()
    computed = {r: sum(n for p in plans for rid, n in zip(p.req_ids, p.num_tokens) if rid == r) for r in h.seqs}
    assert computed["n0"] == 30 + 1  # the prompt, then one decode step
    assert computed["n1"] == computed["n2"] == 30 - 28 + 1  # 7 full blocks of 4 came from the cache
    h.assert_outputs_exact()


def test_a_waiting_request_is_not_held_back_when_the_cache_is_off_or_the_owner_leaves():
    off = Harness(prefix_caching=False)
    off.add("a", list(range(13)), max_tokens=2)
    off.add("b", list(range(13)), max_tokens=2)
    assert off.step().req_ids == ["a", "b"]
    h = Harness()
    h.add("a", list(range(13)), max_tokens=2)
    h.add("b", list(range(13)), max_tokens=2)
    first = h.sched.schedule()
    assert first.req_ids == ["a"]
    h.sched.finish(h.seqs["a"], "abort")  # the request computing the prefix goes away before its result
    second = h.sched.schedule()
    assert second.req_ids == ["b"] and second.new_requests[0].num_computed_tokens == 0
    for plan in (first, second):
        h.sched.update(plan, h.ex.execute(plan))
    h.run()
    assert h.seqs["b"].output_token_ids == expected_output(list(range(13)), 2, VOCAB)


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_sharing_prefixes_finish_exact_through_waits_preemption_and_aborts(seed):
    """Requests from three shared prompt stems (cut anywhere, a few own tokens after) arrive at random steps, into a
    small cache (preemption) and a small budget (chunked prefills), some aborted midway: every step makes progress,
    every request that was not aborted gets exactly its tokens (the fake workers check each position's KV, so a
    prefix taken from the cache before it was computed fails), and every block is free at the end. The run opens
    with three copies of one 9-token prompt, which the first step's budget holds with room to spare, so waits for a
    prefix being computed happen in every run."""
    import random

    rng = random.Random(seed)
    h = Harness(num_blocks=24, max_num_batched_tokens=rng.choice([10, 16, 24]), max_num_seqs=rng.choice([3, 5, 8]))
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 28))] for _ in range(3)]
    arrivals = [stems[0][:9]] * 3 + [rng.choice(stems)[: rng.randrange(2, 29)] + [rng.randrange(VOCAB)
                                                                            for _ in range(rng.randrange(4))]
                                 for _ in range(37)]
    aborted = set()
    for step in range(3000):
        for _ in range(3 if step == 0 else rng.choice([0, 0, 1, 2])):
            if arrivals:
                h.add(f"r{40 - len(arrivals)}", arrivals.pop(0), max_tokens=rng.randrange(1, 7))
        live = [s for s in h.seqs.values() if not s.is_finished]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            h.sched.finish(victim, "abort")
            aborted.add(victim.req_id)
        if not arrivals and not h.sched.has_unfinished():
            break
        assert h.step() is not None or not h.sched.has_unfinished(), "no progress"
    else:
        raise AssertionError("did not finish")
    for req_id, seq in h.seqs.items():
        if req_id not in aborted:
            assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.params.max_tokens, VOCAB), req_id
    assert h.bm.all_free() and h.sched.num_prefix_waits > 0
