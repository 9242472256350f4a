"""What the engine hands back: a request's final output, and the per-step deltas streaming clients consume."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.proto.plan import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # "" when the engine has no tokenizer (dummy weights); never contains a stop string
    token_ids: list[int]  # generated tokens (a stop token id included, as transformers' generate does)
    finish_reason: str | None = None  # None while running, else "stop", "length" or "abort"
    stop_reason: str | None = None  # with "stop": the stop string, or a user stop token's id (None for EOS)
    logprobs: list[TokenLogprobs | None] | None = None  # one per generated token when asked for
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class RequestDelta:
    """What one step added to a request. The last delta of a request has finished=True."""

    request_id: str
    text: str = ""  # new text safe to show (stop-string candidates are held back until decided)
    token_ids: list[int] = field(default_factory=list)  # new generated token ids
    logprobs: list[TokenLogprobs | None] | None = None  # one per entry of token_ids when asked for
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | None = None  # on the final delta, as RequestOutput.stop_reason
    num_prompt_tokens: int = 0
    num_generated: int = 0  # generated tokens so far, this delta included
