"""One row of the sampler's input: a request's sampling settings and its tokens so far (worker/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shardserve.proto.plan import SamplingSpec


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: the request's settings and its tokens so far."""

    spec: SamplingSpec
    token_ids: Sequence[int]  # prompt + generated (the sampled token is not in it yet)
    num_prompt_tokens: int

    @property
    def output_index(self) -> int:
        """Index of the token being generated (0 for the first): the counter of the random draws."""
        return len(self.token_ids) - self.num_prompt_tokens
