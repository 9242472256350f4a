"""Triton kernel: write the step's new K/V into the paged cache at their slots (slot -1 = skip).

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
Its torch reference is the torch backend's store_kv (torch_backend.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program t copies token t's K and V ([num_kv_heads, head_dim] each) to its slot. Grid: (T,)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        # k_cache and v_cache share one shape and stride (asserted by the wrapper)
        dst = block * stride_cache_block + offset * stride_cache_pos + heads * stride_cache_head + dims
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int: slot of each token, -1 = skip
) -> None:
    """Writes k/v into the caches in place at slot_mapping; tokens with slot -1 are not stored."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("store_kv needs head_dim contiguous in k, v and the caches")
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )

