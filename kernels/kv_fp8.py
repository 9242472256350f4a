"""The FP8 KV cache's number format, in torch: float8 e4m3 (4 exponent bits, 3 mantissa bits, no infinities, largest
finite 448) with one float32 scale per KV head of a layer: cached = round_e4m3(clamp(x / scale, -448, 448)) and
x ~= cached * scale. Values beyond 448 * scale saturate instead of becoming NaN.

The attention kernels never multiply the cache by its scale element by element: one program attends one KV head,
so the K scale folds into the softmax scale and the V scale into the output (q.k * s_k and sum(p * v) * s_v).
This file holds the reference quantization the kernels (store_kv.py) are tested against, and the dequantization
the torch backend uses.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] in any float dtype, scale [kv_heads] float32 -> float8 e4m3 (round to nearest
    even, saturating)."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, head_dim: int = -2) -> torch.Tensor:
    """float8 x with its KV heads on dim head_dim (and head_dim last) -> dtype, times each head's scale."""
    shape = [1] * x.dim()
    shape[head_dim] = scale.numel()
    return widen(x, dtype) * scale.view(shape).to(dtype)


@functools.cache
def _e4m3_values(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 1]: the value of every e4m3 byte in dtype, by torch's own conversion (each is exact in every float
    dtype)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(FP8_DTYPE).to(dtype).view(256, 1)


def widen(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 -> dtype, exactly. On the CPU through a 256-entry table (an embedding lookup of the bytes): torch's
    e4m3 conversion there is not vectorised, and the table widens the default model's gate_up weight in 1.6 ms
    against 3.6 (2 threads); elsewhere torch's conversion."""
    if q.is_cuda:
        return q.to(dtype)
    table = _e4m3_values(q.device, dtype)
    return torch.nn.functional.embedding(q.reshape(-1).view(torch.uint8).int(), table).view(q.shape)


def scales_from_amax(amax: torch.Tensor, margin: float) -> torch.Tensor:
    """Per-head scales that map margin x the observed largest magnitude to 448 (a head that saw only zeros gets 1)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * margin / FP8_MAX, torch.ones_like(amax))


# How the decode multiplies an FP8 cache's tiles (the Triton loops are in paged_decode.py / paged_decode_fp8.py):
# "pairs" (the default) reads the cache as int16 pairs of e4m3, which Triton copies and loads as it does a bf16 tile,
# and widens each pair into an even-dims and an odd-dims fp16 tile (the products sum over the dims in any order);
# an e4m3 tile loaded as such Triton 3.6 reads back from shared memory a byte at a time for the products. "fp16"
# widens e4m3 tiles to fp16 (one native conversion; q clamped to fp16's range) and runs the bf16 kernel's products:
# the loop for float32 queries (fp16 pairs would round them), and the reference "pairs" is tested against. Both
# compute the same values (fp16 products of exactly widened tiles) in another order. Other loops (tiles widened to
# the query's dtype, transposed, no tensor cores, the query or the probabilities rounded to e4m3) were slower or
# less accurate and were removed (docs/performance-history.md).
FP8_DECODE_VARIANTS = ("fp16", "pairs")
