"""SamplingParams: how a request is sampled and when it stops. Validated here, at the edge, never in the step loop."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from shardserve.proto.plan import SamplingSpec

MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    seed: int | None = None  # same seed -> same tokens, whatever the batch, preemption or TP size
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None  # never part of the output text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # N in [0, 20]: the sampled token's logprob plus the top N

    def __post_init__(self) -> None:
        self._check()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    def _check(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "a number in [0, 100] (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2**63) or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "an integer in [0, max_tokens]")
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise bad("stop", "a non-empty string or a list of them")
        elif isinstance(self.stop, str) and not self.stop:
            raise bad("stop", "a non-empty string or a list of them")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise bad("stop_token_ids", "a list of token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "True or False")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")

    def to_spec(self, eos_token_ids: list[int], vocab_size: int) -> SamplingSpec:
        """The worker's view. Draws a seed when none was given, so that every rank samples identically."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be token ids below the vocabulary size {vocab_size}, got {t}")
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        return SamplingSpec(
            temperature=float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            seed=self.seed if self.seed is not None else random.getrandbits(63),
            logprobs=-1 if self.logprobs is None else self.logprobs,
            min_tokens=self.min_tokens,
            stop_token_ids=stop_ids,
        )
