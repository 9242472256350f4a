"""The sampler's random draws: a pure function of (seed, index of the token being generated), hashed with
splitmix64 (worker/sampler.py says why there is no generator state). CPU rows take one uniform from their key;
CUDA rows hand the key's two 32-bit halves to the Gumbel kernel (kernels/sampling.py)."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer on a Python int (per-row keys)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=1 << 16)
def _seed_hash(seed: int) -> int:
    """splitmix64(seed), kept per seed: a request draws with the same seed every step."""
    return splitmix64(seed)


def row_key(seed: int, output_index: int) -> int:
    """The per-(request, token index) key from which every vocabulary entry's draw is hashed."""
    return splitmix64(_seed_hash(seed) ^ (output_index & _MASK64))


def row_keys_split(seeds: Sequence[int], output_indices: Sequence[int]) -> list[int]:
    """[low, high 32 bits of row_key(seed, output index)] per row (the Gumbel kernel's key layout), computed
    with numpy's wrapping uint64 arithmetic: the same values as row_key, ~10x faster at batch 256."""
    hashed = np.array([_seed_hash(seed) for seed in seeds], dtype=np.uint64)
    z = hashed ^ np.array([index & _MASK64 for index in output_indices], dtype=np.uint64)
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z = z ^ (z >> np.uint64(31))
    return np.stack([z & np.uint64(0xFFFFFFFF), z >> np.uint64(32)], axis=1).astype(np.int64).ravel().tolist()


def uniform_draw(key: int) -> float:
    """The row's uniform in (0, 1) from its key: the top 52 bits, centred (53 would round the largest to 1.0)."""
    return ((key >> 12) + 0.5) / (1 << 52)
