"""Triton kernel: write the step's new K/V into the paged cache at their slots (slot -1 = skip), quantizing them to
float8 e4m3 with a scale per KV head where the cache is FP8 (kv_fp8.py).

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
Its torch reference is the torch backend's store_kv (torch_backend.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardserve.kernels.kv_fp8 import FP8_MAX, is_fp8


@triton.jit
def _round_to_e4m3(x):
    """x (float32) clamped to +-448 -> the nearest e4m3 value (ties to even), still float32. The conversion to fp8
    is then exact: Triton's interpreter rounds fp32 -> fp8 wrongly when the mantissa carries (7.8 -> 4.0), and on
    the GPU an exact value converts the same. Adding 2^(e+20) to |x| in [2^e, 2^(e+1)) leaves float32 a step of
    2^(e-3), e4m3's step at that exponent (2^-9 below 2^-6, e4m3's subnormals). x's sign bit is put back as a bit:
    a negative x that rounds to zero gives -0 as torch's conversion does (Triton compiles -r as 0 - r, which is +0)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True) & 0x7F800000
    bits = tl.maximum(bits, (127 - 6) << 23)
    big = (bits + (20 << 23)).to(tl.float32, bitcast=True)
    r = (a + big) - big
    sign = x.to(tl.int32, bitcast=True) & (-0x7FFFFFFF - 1)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, scale, FP8_LIMIT: tl.constexpr):
    """x / scale (x float32, scale broadcastable to it) rounded to e4m3, still float32 (its store into an FP8 tensor
    then converts it exactly)."""
    # div_rn: IEEE division, as torch divides (Triton's "/" on float32 may be an approximate division)
    return _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_LIMIT, FP8_LIMIT))


@triton.jit
def quantize_e4m3(x, scale, FP8_LIMIT: tl.constexpr):
    """x [heads, dims] over its heads' scales ([heads] float32): to_e4m3 a head at a time."""
    return to_e4m3(x.to(tl.float32), scale[:, None], FP8_LIMIT)


class KVWrite(NamedTuple):
    """Where a kernel that produces K and V (kernels/rope.py) writes them, in store_kv's place."""
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def check_write(k: torch.Tensor, write: KVWrite) -> bool:
    """Validates a store of k and write.v (store_kv's rules); returns whether the cache is FP8."""
    if write.k_cache.shape != write.v_cache.shape or write.k_cache.stride() != write.v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k.shape != write.v.shape or k.stride(-1) != 1 or write.v.stride(-1) != 1 or write.k_cache.stride(-1) != 1:
        raise ValueError("store_kv needs k and v of one shape, and head_dim contiguous in k, v and the caches")
    fp8 = is_fp8(write.k_cache)
    if fp8 and (write.k_scale is None or write.v_scale is None):
        raise ValueError("an FP8 cache needs k_scale and v_scale")
    return fp8


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr,
):
    """Program t copies token t's K and V ([num_kv_heads, head_dim] each) to its slot. Grid: (T,)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)
        heads = h[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if FP8:
            k = quantize_e4m3(k, tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0), FP8_LIMIT)
            v = quantize_e4m3(v, tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0), FP8_LIMIT)
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
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes k/v into the caches in place at slot_mapping; tokens with slot -1 are not stored."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    fp8 = check_write(k, KVWrite(v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k, v_scale if fp8 else v,  # unused without FP8
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, FP8_LIMIT=FP8_MAX,
    )


@triton.jit
def _decode_slots_kernel(positions_ptr, seq_lens_ptr, tables_ptr, slots_ptr, seq_lens32_ptr, n, stride_bt,
                         block_size, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK),). Row i of a decode batch: its slot, tables[i, pos // block_size] * block_size +
    pos % block_size, or -1 where its context length is 0 (a padding row); and its context length as int32."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    pos = tl.load(positions_ptr + i, mask=ok, other=0)
    length = tl.load(seq_lens_ptr + i, mask=ok, other=0)
    live = ok & (length > 0)
    block = tl.load(tables_ptr + i.to(tl.int64) * stride_bt + pos // block_size, mask=live, other=0).to(tl.int64)
    tl.store(slots_ptr + i, tl.where(live, block * block_size + pos % block_size, -1), mask=ok)
    tl.store(seq_lens32_ptr + i, length.to(tl.int32), mask=ok)


def decode_slots(positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch's cache slots ([n] int64; -1 for rows whose context length is 0) and its context lengths as
    int32, row i's table being block_tables[i]: one launch for what is otherwise ~9 small torch kernels a step
    (worker/input_batch.py: slot_mapping, the reference)."""
    n = positions.shape[0]
    slots = torch.empty(n, dtype=torch.int64, device=positions.device)
    seq_lens32 = torch.empty(n, dtype=torch.int32, device=positions.device)
    if n:
        _decode_slots_kernel[(triton.cdiv(n, 256),)](positions, seq_lens, block_tables, slots, seq_lens32, n,
                                                    block_tables.stride(0), block_size, BLOCK=256)
    return slots, seq_lens32
