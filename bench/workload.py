"""Synthetic workloads: random token-id prompts with lengths uniform in a range (nano-vllm's offline workload)."""

from __future__ import annotations

import random
from dataclasses import dataclass


def parse_range(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "100-1024" or "100,1024" -> (100, 1024)."""
    parts = text.replace(",", "-").split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise ValueError(f"a length range is N or LOW-HIGH, got {text!r}") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ValueError(f"a length range is N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0, avoid_ids: set[int] = frozenset()) -> Workload:
    rng = random.Random(seed)
    usable = [t for t in range(100, min(vocab_size, 32000)) if t not in avoid_ids]  # past the special tokens
    prompts = [[rng.choice(usable) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    outputs = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, outputs)
