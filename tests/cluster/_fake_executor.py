"""A deterministic stand-in for the workers that enforces the StepPlan delta semantics (proto/plan.py).

It keeps worker-side state exactly as a real worker would (token lists, block tables, computed counts), "samples"
next = (last * 7 + 3) % vocab, and stores per slot which (token, position) its KV holds, so it notices:
- a step id that is not the previous one + 1;
- a request scheduled without ever being sent, or sent twice without being dropped;
- a resumed request whose token list is not everything generated so far (the nano-vllm preemption bug);
- computing a position whose earlier positions' KV is missing or wrong (bad prefix hit, freed block reused
  while still needed, a block table that lost an appended block);
- positions beyond the request's known tokens.

fail_at_step makes it fail on demand, as a lost TP group does: that plan and every later call raise WorkerError
(after the plan ran, when fail_after_running: its tokens were sampled but never reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.cluster.executor import WorkerError
from shardserve.proto.plan import NewRequest, StepPlan, StepResult, TokenLogprobs


def next_token(last: int, vocab_size: int) -> int:
    return (last * 7 + 3) % vocab_size


def expected_output(prompt: list[int], n: int, vocab_size: int, stop_ids=(), min_tokens: int = 0) -> list[int]:
    """What a request generates with this executor when nothing else stops it (mirrors its min_tokens mask)."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = _sample(last, vocab_size, stop_ids, len(out) < min_tokens)
        out.append(last)
        if last in stop_ids and len(out) > min_tokens:
            break
    return out


def _sample(last: int, vocab_size: int, stop_ids, masked: bool) -> int:
    token = next_token(last, vocab_size)
    while masked and token in stop_ids:  # like the real sampler: stop ids cannot be drawn before min_tokens
        token = (token + 1) % vocab_size
    return token


@dataclass
class _WorkerRequest:
    new: NewRequest
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeExecutor:
    num_kv_blocks: int
    block_size: int
    vocab_size: int = 1000
    plans: list[StepPlan] = field(default_factory=list)
    requests: dict[str, _WorkerRequest] = field(default_factory=dict)
    history: dict[str, list[int]] = field(default_factory=dict)  # every token ever known per id, across preemption
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (token, position) written there
    dropped_finished: list[str] = field(default_factory=list)
    dropped_preempted: list[str] = field(default_factory=list)
    shut_down: bool = False
    script: dict[str, list[int]] = field(default_factory=dict)  # req id -> the tokens it "samples", in order
    fail_at_step: int | None = None  # this step and every later call raise WorkerError
    fail_after_running: bool = False  # the failing step runs first (its sampled tokens are lost with the group)
    failed: bool = False

    def execute(self, plan: StepPlan) -> StepResult:
        if self.failed:
            raise WorkerError("the fake TP group failed earlier")
        if plan.step_id == self.fail_at_step:
            if self.fail_after_running:
                self._execute(plan)
            self.failed = True
            raise WorkerError(f"the fake TP group failed in step {plan.step_id}")
        return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepResult:
        expected_step = self.plans[-1].step_id + 1 if self.plans else 1
        assert plan.step_id == expected_step, f"step id {plan.step_id}, expected {expected_step}"
        self.plans.append(plan)
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            assert req_id in self.requests, f"dropping {req_id}, which the workers do not hold"
            del self.requests[req_id]
        self.dropped_finished += plan.finished_req_ids
        self.dropped_preempted += plan.preempted_req_ids
        for new in plan.new_requests:
            assert new.req_id not in self.requests, f"{new.req_id} sent twice"
            known = self.history.get(new.req_id)
            if known is not None:  # resumed after preemption: must carry every token generated before
                assert new.token_ids == known, f"{new.req_id} resumed with {new.token_ids}, workers had {known}"
            assert new.num_computed_tokens % self.block_size == 0
            assert new.num_computed_tokens < len(new.token_ids), "a prefix hit must leave a token to compute"
            self.history[new.req_id] = list(new.token_ids)
            self.requests[new.req_id] = _WorkerRequest(new, list(new.token_ids), list(new.block_ids),
                                                       new.num_computed_tokens)
        assert len(plan.req_ids) == len(plan.num_tokens) == len(set(plan.req_ids))
        for req_id in plan.new_block_ids:
            assert req_id in plan.req_ids, "new blocks for a request not scheduled"
        result = StepResult(step_id=plan.step_id)
        for req_id, n in zip(plan.req_ids, plan.num_tokens):
            assert req_id in self.requests, f"{req_id} scheduled but never sent"
            req = self.requests[req_id]
            req.block_ids += plan.new_block_ids.get(req_id, [])
            drafts = plan.draft_token_ids.get(req_id)
            if drafts:  # speculation: the drafts are computed with the last token, then verified
                assert n == 1 + len(drafts) and req.num_computed + 1 == len(req.tokens), f"{req_id}: bad drafts"
                req.tokens += drafts
            assert n >= 1 and req.num_computed + n <= len(req.tokens), f"{req_id}: bad token count {n}"
            self._check_prefix_kv(req)
            for pos in range(req.num_computed, req.num_computed + n):
                assert pos // self.block_size < len(req.block_ids), f"{req_id}: no block for position {pos}"
                self.kv[self._slot(req, pos)] = (req.tokens[pos], pos)
            req.num_computed += n
            if drafts:
                self._verify(req_id, req, drafts, result)
            elif req.num_computed == len(req.tokens):
                spec = req.new.sampling
                generated = len(req.tokens) - req.new.num_prompt_tokens
                if req_id in self.script:
                    token = self.script[req_id][generated]
                else:
                    token = _sample(req.tokens[-1], self.vocab_size, spec.stop_token_ids, generated < spec.min_tokens)
                req.tokens.append(token)
                self.history[req_id].append(token)
                result.req_ids.append(req_id)
                result.token_ids.append(token)
                lp = TokenLogprobs(-0.5, [token], [-0.5]) if spec.logprobs >= 0 else None
                result.logprobs.append(lp)
        return result

    def _next(self, req_id: str, req: _WorkerRequest, tokens: list[int]) -> int:
        """The token this fake samples after `tokens` (the request's list up to a position)."""
        spec = req.new.sampling
        generated = len(tokens) - req.new.num_prompt_tokens
        if req_id in self.script:
            return self.script[req_id][generated]
        return _sample(tokens[-1], self.vocab_size, spec.stop_token_ids, generated < spec.min_tokens)

    def _verify(self, req_id: str, req: _WorkerRequest, drafts: list[int], result: StepResult) -> None:
        """Keeps the drafts up to the first one that differs from what would be sampled there, plus that sample;
        drops the rest as a worker does (computed count, block table)."""
        base = len(req.tokens) - len(drafts)
        kept = []
        for j in range(len(drafts) + 1):
            kept.append(self._next(req_id, req, req.tokens[: base + j]))
            if j == len(drafts) or kept[-1] != drafts[j]:
                break
        del req.tokens[base:]
        req.tokens += kept
        req.num_computed = len(req.tokens) - 1
        del req.block_ids[-(-len(req.tokens) // self.block_size):]
        self.history[req_id] = list(req.tokens)
        for token in kept:
            result.req_ids.append(req_id)
            result.token_ids.append(token)
            result.logprobs.append(TokenLogprobs(-0.5, [token], [-0.5]) if req.new.sampling.logprobs >= 0 else None)

    def _slot(self, req: _WorkerRequest, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _check_prefix_kv(self, req: _WorkerRequest) -> None:
        for pos in range(req.num_computed):
            got = self.kv.get(self._slot(req, pos))
            assert got == (req.tokens[pos], pos), f"{req.new.req_id}: KV at position {pos} is {got}"

    def shutdown(self) -> None:
        self.shut_down = True
