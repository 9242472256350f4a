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
import os

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


# How the decode multiplies an FP8 cache's tiles (SHARDSERVE_FP8_DECODE selects one; the Triton loops are in
# paged_decode.py / paged_decode_fp8.py, measured on an H200 in docs/performance-history.md): "pairs" (the default) reads the
# cache as int16 pairs of e4m3, which Triton copies and loads as it does a bf16 tile, and widens each pair into an
# even-dims and an odd-dims fp16 tile (the products sum over the dims in any order): 96% of the copy rate at
# 64 x 4,096 and offline Qwen3-0.6B 32.4-33.7k out tok/s against the "fp16" loop's 22.5k. Every other loop loads e4m3
# tiles as such, which Triton 3.6 reads back from shared memory a byte at a time for the products (128 one-byte
# loads per thread per tile: they took as long per key as bf16 does for twice the bytes). "widen" converts each
# tile to the query's dtype and runs the bf16 kernel's products; "fp16" converts to fp16 instead (one native
# conversion; q clamped to fp16's range; the default before "pairs"); "transposed" also puts the converted tiles
# first in both products; "k_transposed_load" loads K in its [head_dim, keys] shape; "fma" uses no tensor cores.
# "e4m3_qk" rounds the query to e4m3 (round_query_e4m3) and multiplies it with the K tiles as stored, p and V as
# fp16; "e4m3" also rounds the probabilities to e4m3 (both raise the cache's divergence on the default model: the
# query's rounding by 61%). The torch path (CPU) rounds the query as the e4m3 loops do, so that their effect on
# outputs can be measured with a model's real weights where no GPU can hold it. "pairs" and "fp16" compute the
# same values (fp16 products of exactly widened tiles) in another order.
FP8_DECODE_VARIANTS = ("widen", "fp16", "transposed", "k_transposed_load", "fma", "e4m3_qk", "e4m3", "pairs")


def fp8_decode_variant() -> str:
    variant = os.environ.get("SHARDSERVE_FP8_DECODE", "pairs")
    if variant not in FP8_DECODE_VARIANTS:
        raise ValueError(f"SHARDSERVE_FP8_DECODE must be one of {', '.join(FP8_DECODE_VARIANTS)}; got {variant!r}")
    return variant


def rounds_query(variant: str) -> bool:
    return variant.startswith("e4m3")


def round_query_e4m3(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] as the e4m3 decode loops see it: each (sequence, KV head)'s group of query
    heads rounded to e4m3 with one scale (their largest magnitude -> 448), in float32."""
    groups = q.float().unflatten(1, (num_kv_heads, -1))
    scale = groups.abs().amax(dim=(2, 3), keepdim=True).clamp_min(1e-30) / FP8_MAX
    return ((groups / scale).to(FP8_DTYPE).float() * scale).flatten(1, 2)
