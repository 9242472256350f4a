"""The FP8 KV cache's number format, in torch: float8 e4m3 (4 exponent bits, 3 mantissa bits, no infinities, largest
finite 448) with one float32 scale per KV head of a layer: cached = round_e4m3(clamp(x / scale, -448, 448)) and
x ~= cached * scale. Values beyond 448 * scale saturate instead of becoming NaN.

The attention kernels never multiply the cache by its scale element by element: one program attends one KV head,
so the K scale folds into the softmax scale and the V scale into the output (q.k * s_k and sum(p * v) * s_v).
This file holds the reference quantization the kernels (store_kv.py) are tested against, and the dequantization
the torch backend uses.
"""

from __future__ import annotations

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
    return x.to(dtype) * scale.view(shape).to(dtype)


def scales_from_amax(amax: torch.Tensor, margin: float) -> torch.Tensor:
    """Per-head scales that map margin x the observed largest magnitude to 448 (a head that saw only zeros gets 1)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * margin / FP8_MAX, torch.ones_like(amax))
