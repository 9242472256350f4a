"""What the engine hands back, in vLLM's shapes: a request's output (RequestOutput with its CompletionOutputs), the
per-step deltas streaming clients consume, and logprobs as one dict per position, {token id: Logprob}."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.proto.plan import TokenLogprobs


@dataclass(slots=True, frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 + the number of tokens more likely than this one
    decoded_token: str | None = None  # the token alone, decoded (None without a tokenizer)


# One position's logprobs: the sampled (or prompt) token first, then the top N not already in it, best first.
PositionLogprobs = dict[int, Logprob]


class TokenTexts:
    """Token id -> the token alone, decoded (Logprob.decoded_token), cached; None without a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._texts) < 65536:  # a bounded cache: vocabularies are ~50k-250k
                self._texts[token_id] = text
        return text


def position_logprobs(token_id: int, lp: TokenLogprobs, decode: Callable[[int], str | None]) -> PositionLogprobs:
    """The wire's TokenLogprobs of `token_id` as vLLM's dict."""
    entries = {token_id: Logprob(lp.logprob, lp.rank, decode(token_id))}
    for rank, (top_id, top_lp) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
        if top_id not in entries:
            entries[top_id] = Logprob(top_lp, rank, decode(top_id))
    return entries


def top_entries(entries: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The top n of a position's dict, best first (the chosen token among them when it ranks there)."""
    return sorted(entries.items(), key=lambda item: item[1].rank or 0)[:n] if n > 0 else []


@dataclass(slots=True)
class CompletionOutput:
    index: int  # i of the prompt's n outputs (SamplingParams.n; LLM.generate), else 0
    text: str  # "" when the engine has no tokenizer (dummy weights); a stop string only with include_stop_str_in_output
    token_ids: list[int]  # generated tokens (a stop token id included, as transformers' generate does)
    cumulative_logprob: float | None  # the sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[PositionLogprobs] | None  # one per generated token when asked for
    finish_reason: str | None = None  # None while running, else "stop", "length" or "abort"
    stop_reason: int | str | None = None  # with "stop": the stop string or a user stop token's id (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # with prompt_logprobs: one per prompt token, None first
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class RequestDelta:
    """What one step added to a request. The last delta of a request has finished=True."""

    request_id: str
    text: str = ""  # new text safe to show (stop-string candidates are held back until decided)
    token_ids: list[int] = field(default_factory=list)  # new generated token ids
    logprobs: list[PositionLogprobs] | None = None  # one per entry of token_ids when asked for
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # on the final delta, as CompletionOutput.stop_reason
    num_prompt_tokens: int = 0
    num_generated: int = 0  # generated tokens so far, this delta included
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at its first admission)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the request's first delta, when asked for
    queue_time_s: float | None = None  # on the request's first delta: from admission to its first plan
    error: str | None = None  # on a final delta: why the request could not go on (the server: RESOURCE_EXHAUSTED)
