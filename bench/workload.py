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


FIRST_ID, LAST_ID = 100, 32000  # prompt ids come from [FIRST_ID, min(vocab, LAST_ID)): past the special tokens


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

    def shifted(self, k: int, vocab_size: int) -> "Workload":
        """The same lengths with every prompt token moved k * 1009 places within random_workload's range of ids: a
        run of it finds nothing of an earlier run's prompts in the prefix cache (k = 0: this workload)."""
        low, high = FIRST_ID, min(vocab_size, LAST_ID)
        offset = (1009 * k) % (high - low)
        if k and not offset:  # a range of a multiple of 1009 ids
            offset = 1
        prompts = [[low + (t - low + offset) % (high - low) for t in p] for p in self.prompts]
        return Workload(prompts, list(self.output_lens))


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0, avoid_ids: set[int] = frozenset()) -> Workload:
    rng = random.Random(seed)
    usable = [t for t in range(FIRST_ID, min(vocab_size, LAST_ID)) if t not in avoid_ids]
    prompts = [[rng.choice(usable) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    outputs = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, outputs)
