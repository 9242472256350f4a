"""What the two Triton attention kernels (paged_decode.py, prefill.py) share: the paged-cache layout they check,
the precision of their dot products, their log2-domain constants, and the check of an FP8 cache's scales."""

from __future__ import annotations

import torch
import triton.language as tl

from shardserve.kernels.kv_fp8 import is_fp8

LOG2E = 1.4426950408889634  # scores are kept in the log2 domain: exp2(x * log2(e)) == exp(x)
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps empty splits and masked tiles free of NaN


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: full fp32 for fp32 inputs (fp32 runs are correctness runs, held to transformers'
    fp32 logits; tf32 would round the inputs to 10 mantissa bits), the default elsewhere (bf16/fp16 ignore it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """The layout both attention kernels rely on; returns (num_kv_heads, query heads per KV head)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.stride() != v_cache.stride() or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need head_dim contiguous, and k_cache/v_cache the same strides")
    return num_kv_heads, num_heads // num_kv_heads


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """True for an FP8 cache, which needs its per-KV-head scales ([num_kv_heads] float32, contiguous)."""
    if not is_fp8(k_cache):
        return False
    num_kv_heads = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.shape != (num_kv_heads,) or s.dtype != torch.float32:
            raise ValueError(f"an FP8 cache needs {name} as [{num_kv_heads}] float32, got {s if s is None else s.shape}")
    return True
