"""A request's state on the controller: its tokens, block table, status and what has been streamed so far.

A `Request` is owned by the scheduler while the request is live. Token lists only grow by appends,
so everything per step is O(1) per request; the only O(tokens) work happens at admission (hashing the prompt's
blocks once) and when a preempted request is resent to the workers in full.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardserve.cluster.outputs import (CompletionOutput, PositionLogprobs, RequestDelta, RequestOutput,
                                        position_logprobs)
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.plan import SamplingSpec, TokenLogprobs

if TYPE_CHECKING:
    from shardserve.cluster.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds blocks; scheduled each step while budget allows
    PREEMPTED = "preempted"  # blocks taken away; waits at the front of the queue to be recomputed
    FINISHED = "finished"  # done or aborted; its blocks are free


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    spec: SamplingSpec = field(default_factory=SamplingSpec)  # params.to_spec(eos) at admission
    arrival: int = 0  # FCFS order; preemption picks the highest
    prompt: str | None = None
    stop_token_set: frozenset[int] = frozenset()  # spec.stop_token_ids, for O(1) checks each step
    arrived_at: float = field(default_factory=time.perf_counter)  # admission (perf_counter seconds)
    first_scheduled_at: float | None = None  # the first plan that computed it (queue time = this - arrived_at)

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + generated (tokens whose value is known)
    output_token_ids: list[int] = field(default_factory=list)  # generated only
    # One per generated token when asked for: the workers' TokenLogprobs, turned into vLLM's dict by the engine
    logprobs: list[TokenLogprobs | PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0  # the sum of the sampled tokens' logprobs (when asked for)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # one per prompt token when asked for
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # with "stop": the stop string, or the id of a user stop token (None for EOS)

    # KV bookkeeping
    num_computed_tokens: int = 0  # positions scheduled for computation (advanced when a plan is made)
    num_pending_tokens: int = 0  # sampled by the workers (a plan reached the end of the list) but not yet reported
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (for stats)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the full blocks of token_ids known so far
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    known_to_workers: bool = False  # False: the next plan must send it as a NewRequest (first time or resumed)
    epoch: int = 0  # +1 per preemption: results of plans made before it must not touch the new block table
    last_step_id: int = 0  # the last plan that computed it: its blocks stay allocated until that plan's result
    num_new_tokens: int = 0  # tokens the last applied result appended (more than 1 where drafts were accepted)
    draft_index: Any = None  # the speculative proposer's state for this request (cluster/speculation.py)
    num_tokens_sent: int = 0  # pipeline stages: token_ids[:n] the stages before the last have (they do not sample)

    # streaming
    detokenizer: IncrementalDetokenizer | None = None
    num_emitted_tokens: int = 0  # output_token_ids[:n] (and logprobs[:n]) already sent as deltas

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.stop_token_set:
            self.stop_token_set = frozenset(self.spec.stop_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the workers will know once every sent plan has run (known + pending samples)."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, counting those sampled but not yet reported."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keeps the first num_output_tokens generated tokens (a stop inside a run of accepted drafts)."""
        del self.token_ids[self.num_prompt_tokens + num_output_tokens :]
        del self.output_token_ids[num_output_tokens:]
        if self.logprobs is not None:
            del self.logprobs[num_output_tokens:]

    def fill_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs], token_text) -> None:
        """The prompt positions from start that a step scored, where asked (once each: a recomputed request
        reports them again). token_text: token id -> its text (outputs.TokenTexts)."""
        if self.prompt_logprobs is None:
            return
        for position, lp in enumerate(logprobs, start=start):
            if position < len(self.prompt_logprobs) and self.prompt_logprobs[position] is None:
                token = self.prompt_token_ids[position]
                self.prompt_logprobs[position] = position_logprobs(token, lp, token_text)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)

    # ---- what the engine hands back ----------------------------------------------------------------------
    def delta(self, final: bool) -> RequestDelta:
        """What the request gained since its last delta (text, tokens, logprobs), and marks it emitted."""
        start = self.num_emitted_tokens
        self.num_emitted_tokens = len(self.output_token_ids)
        return RequestDelta(
            request_id=self.req_id,
            text=self.detokenizer.take_delta(final) if self.detokenizer is not None else "",
            token_ids=self.output_token_ids[start:],
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs if start == 0 else None,
            queue_time_s=(self.first_scheduled_at - self.arrived_at
                          if start == 0 and self.first_scheduled_at is not None else None),
            finished=final,
            finish_reason=self.finish_reason if final else None,
            stop_reason=self.stop_reason if final else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated=len(self.output_token_ids),
            num_cached_tokens=self.num_cached_tokens,
        )

    def output(self) -> RequestOutput:
        """The request's whole output so far (final once it has finished)."""
        completion = CompletionOutput(
            index=0,
            text=self.detokenizer.text if self.detokenizer is not None else "",
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=[completion],
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
        )
