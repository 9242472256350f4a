"""Structured outputs on a worker: one grammar matcher per constrained request, advanced with the tokens the request
generated, and the mask of the tokens its grammar allows next applied to its logits before every sampling step.

Where the matcher runs (docs/architecture.md, "Structured outputs"): on every rank, each advancing its own copy with
the token every rank samples (worker/sampler.py draws the same token on every rank). So the plan carries a request's
grammar once (SamplingSpec.grammar_kind / grammar, compiled here and cached by its text) and nothing per step: a
mask shipped from the controller would cost 19 KiB a row and step at Qwen's 152k vocabulary, and it could not be
computed before the token it follows is known, which the controller learns a step late under async scheduling.

The matcher reads the request's own token list: before each mask it consumes the generated tokens it has not seen
(the sampled token of the step before, or every generated token of a request resumed after preemption), so it
needs those values on the host. A step with a constrained row therefore reads the previous step's tokens back
before its own sampling (worker/input_batch.py: sampling_rows), after its forward is queued: the device runs the
forward while the host waits and fills the masks. Unconstrained rows are untouched (their logits, their
launch-ahead): the mask is applied to the constrained rows only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.proto.grammar import grammar_compiler
from shardserve.proto.plan import StepPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int = 0  # generated tokens accepted so far
    broken: bool = False  # a generated token the grammar refused (a resumed client's tokens): no longer constrained


class GrammarMatchers:
    """This rank's matchers by request id, and one reusable bitmask buffer."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._matchers: dict[str, _Matcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32 on the host
        self.last_mask_s = 0.0  # the last masked step's host time: catching up, filling, applying

    def drop(self, plan: StepPlan) -> None:
        """Forgets requests the plan drops or sends anew (a resumed request's matcher starts over and catches up)."""
        if not self._matchers:
            return
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self._matchers.pop(req_id, None)
        for new in plan.new_requests:
            self._matchers.pop(new.req_id, None)

    def mask(self, logits: torch.Tensor, req_ids: list[str], rows: list[Any]) -> None:
        """Sets to -inf, in place, every logit a constrained row's grammar does not allow next. rows: SamplingRows
        (worker/sampler.py) whose token lists hold values, not placeholders."""
        import xgrammar as xgr

        started = time.perf_counter()
        bitmask = self._buffer(len(rows))
        masked = []
        for i, (req_id, row) in enumerate(zip(req_ids, rows)):
            spec = row.spec
            if not spec.grammar_kind:
                continue
            state = self._matchers.get(req_id)
            if state is None:
                compiled = grammar_compiler(self.tokenizer_dir, self.vocab_size).compile(spec.grammar_kind, spec.grammar)
                state = self._matchers[req_id] = _Matcher(
                    xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=list(spec.stop_token_ids)))
            generated = row.token_ids[row.num_prompt_tokens + state.consumed:]
            if not state.broken:
                for token in generated:
                    if not state.matcher.accept_token(token):
                        log.warning("request %s: its grammar refuses generated token %d; no longer constrained",
                                    req_id, token)
                        state.broken = True
                        break
            state.consumed += len(generated)
            if state.broken or state.matcher.is_terminated():  # terminated: its stop token is in, the row ends
                continue
            state.matcher.fill_next_token_bitmask(bitmask, i)
            masked.append(i)
        if masked:
            mask = bitmask[: len(rows)]
            if logits.device.type == "cuda":  # a fresh pinned copy: the buffer is written again next step
                mask = mask.pin_memory().to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=masked)
        self.last_mask_s = time.perf_counter() - started

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            size = max(rows, 64 if self._bitmask is None else 2 * self._bitmask.shape[0])
            self._bitmask = xgr.allocate_token_bitmask(size, self.vocab_size)
        return self._bitmask
