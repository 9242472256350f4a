"""Verifying proposed (draft) tokens: a step whose plan carries StepPlan.draft_token_ids.

A request with d drafts computes d + 1 positions in the step's one forward: its last known token and the drafts
(the same varlen prefill/extend path a prefill chunk takes). Each of the d + 1 positions is sampled exactly as a
plain decode step would sample it: the same transforms over the tokens before it (drafts included) and the same
random draw, a pure function of (seed, index of the generated token) (worker/sampler.py). The drafts are kept up
to the first one that differs from the sample at its position; that sample is kept too, so a step gains 1 to
d + 1 tokens.

Why this keeps the target's distribution exactly: an n-gram draft is a point mass q (one token, probability 1).
Standard speculative sampling accepts a draft x with probability min(1, p(x) / q(x)) = p(x) and otherwise draws
from the residual max(0, p - q), normalised, which is p with x removed. Sampling y ~ p and accepting x iff y == x
does the same: x comes out with probability p(x), any other y with p(y). Coupled to the request's own draw, it
also gives the very tokens decoding without speculation gives (greedy: the argmax; seeded: the same draw), so a
request's output does not depend on speculation, on the batch or on where drafts were rejected.

Every rank verifies the same logits with the same draws, so every rank keeps the same tokens; rank 0 reports them
(the result lists a request once per token it gained). The rejected drafts' positions are dropped on both sides:
the request's computed count ends before its new last token and its block table is cut to the blocks its tokens
occupy (cluster/scheduler.py applies the same rule).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from shardserve.proto.plan import StepPlan, StepResult, cdiv
from shardserve.worker.device_copy import device_tensor
from shardserve.worker.step_inputs import StepInputs
from shardserve.worker.sampler import sample_tokens
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.token_logprobs import token_logprobs
from shardserve.worker.step_in_flight import StepInFlight


def accepted_count(drafts: list[int], samples: list[int]) -> int:
    """How many leading drafts equal the samples at their positions (samples has one more entry than drafts)."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


def launch_verify_step(runner: Any, plan: StepPlan, batch: StepInputs) -> StepInFlight:
    """runner: the ModelRunner (its forward, LM head, device and prompt-logprob hand-off).
    The step of a plan with drafts, run to completion (speculation runs without async scheduling: the next
    plan's proposals need the tokens this one keeps). Returns a StepInFlight whose result is already filled in."""
    started = time.perf_counter()
    step = StepInFlight(StepResult(step_id=plan.step_id))
    if not batch.states:
        return step
    step.start_device_timer(runner.device)
    hidden, _ = runner._forward(batch, plan.step_id)
    drafts_of = plan.draft_token_ids
    ends = list(itertools.accumulate(batch.query_lens))  # each request's rows end here in `hidden`
    hidden_rows: list[int] = []
    rows: list[SamplingRow] = []
    row_req_ids: list[str] = []
    groups = []  # (req_id, state, drafts, seq_len) per sampling request, in batch order
    for i in batch.sample_rows:
        state, req_id, seq_len = batch.states[i], plan.req_ids[i], batch.seq_lens[i]
        drafts = drafts_of.get(req_id, ())
        d = len(drafts)
        for j in range(d + 1):  # row j scores the token after position seq_len - d - 1 + j
            hidden_rows.append(ends[i] - 1 - d + j)
            rows.append(SamplingRow(state.sampling, state.token_ids[: seq_len - d + j], state.num_prompt_tokens))
            row_req_ids.append(req_id)
        groups.append((req_id, state, drafts, seq_len))
    result = step.result
    if rows:
        logits = runner.model.compute_logits(hidden[device_tensor(hidden_rows, torch.int64, runner.device)])
        if any(r.spec.grammar_kind for r in rows):  # structured rows (never drafted: one row each) are masked
            runner.grammars.mask(logits, row_req_ids, rows)
            result.grammar_mask_ms = runner.grammars.last_mask_s * 1e3
        sampled = sample_tokens(logits, rows)
        samples = sampled.tolist()
        logprobs = token_logprobs(logits, rows, sampled)
        step.stop_device_timer()
        r = 0
        bs = runner.block_size
        for req_id, state, drafts, seq_len in groups:
            d = len(drafts)
            a = accepted_count(drafts, samples[r : r + d + 1])
            kept = seq_len - d + a  # the tokens before this step's last known one, plus the accepted drafts
            del state.token_ids[kept:]
            state.token_ids.append(samples[r + a])
            state.num_computed = kept
            del state.block_ids[cdiv(len(state.token_ids), bs):]  # rejected drafts' blocks (the controller's rule)
            result.req_ids += [req_id] * (a + 1)
            result.token_ids += samples[r : r + a + 1]
            result.logprobs += logprobs[r : r + a + 1]
            r += d + 1
    runner._launch_prompt_logprobs(plan, batch, hidden, step)
    step.host_s = time.perf_counter() - started
    return step
