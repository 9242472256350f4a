"""Triton rotary position embedding, neox style (rotate-half), applied in place to q and k; optionally with
Qwen3's per-head RMSNorm of q and k fused in front (one launch instead of three).

Cache layout (matches worker/layers/rotary.py): cos_cache and sin_cache, each [max_position, rot_dim / 2],
float32, indexed by position. The first rot_dim dims of each head are rotated (rot_dim = 2 * cache width, at
most head_dim; equal to it for Llama/Qwen): with x1, x2 the two halves,
out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin, computed in float32 and rounded once.
With norm weights, each head is first normalised as worker/layers/norm.py does (float32 statistics, rounded to
the model dtype, times the weight, rounded again); this needs rot_dim == head_dim.
With a KVWrite the same launch also does store_kv's work: the rotated k and the step's v go straight into the
paged cache (quantized for an FP8 one), one kernel a layer fewer (the layer takes it on CUDA: decoder.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.kv_fp8 import FP8_MAX
from shardserve.kernels.pdl import chained, start_as_dependent
from shardserve.kernels.store_kv import KVWrite, check_write, quantize_e4m3


@triton.jit
def _load_halves(row_ptr, stride_h, heads, num_heads, cols, HALF: tl.constexpr):
    """A token's heads (rows of row_ptr, stride_h apart) as their two halves, in float32."""
    mask = (heads < num_heads) & (cols < HALF)
    first = row_ptr + heads * stride_h + cols
    return (tl.load(first, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _rotate_halves(x1, x2, w_ptr, cols, cos, sin, eps, DTYPE: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Heads given as float32 halves (normalised and) rotated: the two halves, rounded to DTYPE."""
    if NORM:  # RMSNorm over the whole head (rot_dim == head_dim = 2 * HALF)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * rstd[:, None]).to(DTYPE).to(tl.float32) * w1
        x2 = (x2 * rstd[:, None]).to(DTYPE).to(tl.float32) * w2
        x1 = x1.to(DTYPE).to(tl.float32)
        x2 = x2.to(DTYPE).to(tl.float32)
    return (x1 * cos - x2 * sin).to(DTYPE), (x2 * cos + x1 * sin).to(DTYPE)


@triton.jit
def _store_halves(ptr, dst, x1, x2, scale, mask, HALF: tl.constexpr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """Both halves of a token's heads at ptr + dst (q or k in place, or the cache: quantized with the heads'
    scales, [heads] float32, where it is FP8)."""
    if FP8:
        x1 = quantize_e4m3(x1, scale, FP8_LIMIT)
        x2 = quantize_e4m3(x2, scale, FP8_LIMIT)
    tl.store(ptr + dst, x1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + dst + HALF, x2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_cache_block, stride_cache_pos, stride_cache_head, block_size,
    num_q_heads, num_k_heads, eps,
    HALF: tl.constexpr, NORM: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (T,). Program t (normalises and) rotates every q and k head of token t by the angles of positions[t].
    q is rotated in place; k too, or with STORE written with v straight into the paged cache at slot_ptr[t] (as
    kernels/store_kv.py would; slot -1: not stored). PDL: launched as a programmatic dependent (kernels/pdl.py)."""
    if PDL:
        start_as_dependent()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    q_heads = tl.arange(0, BLOCK_QH)[:, None]
    k_heads = tl.arange(0, BLOCK_KH)[:, None]
    # Every load first, stores last: a store may alias a later load as far as the compiler knows, so a load
    # written after a store waits for it (q, k, v and the cache are distinct memory here).
    pos = tl.load(positions_ptr + token).to(tl.int64)
    q1, q2 = _load_halves(q_ptr + token * stride_qt, stride_qh, q_heads, num_q_heads, cols, HALF)
    k1, k2 = _load_halves(k_ptr + token * stride_kt, stride_kh, k_heads, num_k_heads, cols, HALF)
    if STORE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        v1, v2 = _load_halves(v_ptr + token * stride_vt, stride_vh, k_heads, num_k_heads, cols, HALF)
        k_scale = None  # an FP8 cache's per-head scales
        v_scale = None
        if FP8:
            kv_heads = tl.arange(0, BLOCK_KH)
            k_scale = tl.load(k_scale_ptr + kv_heads, mask=kv_heads < num_k_heads, other=1.0)
            v_scale = tl.load(v_scale_ptr + kv_heads, mask=kv_heads < num_k_heads, other=1.0)
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    q1, q2 = _rotate_halves(q1, q2, q_norm_ptr, cols, cos, sin, eps, dtype, HALF, NORM)
    k1, k2 = _rotate_halves(k1, k2, k_norm_ptr, cols, cos, sin, eps, dtype, HALF, NORM)
    _store_halves(q_ptr, token * stride_qt + q_heads * stride_qh + cols, q1, q2, None,
                  (q_heads < num_q_heads) & (cols < HALF), HALF, False, FP8_LIMIT)
    k_mask = (k_heads < num_k_heads) & (cols < HALF)
    if STORE:  # rot_dim == head_dim: the two halves are the whole head
        if slot >= 0:
            dst = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_pos
            dst += k_heads * stride_cache_head + cols
            _store_halves(k_cache_ptr, dst, k1, k2, k_scale, k_mask, HALF, FP8, FP8_LIMIT)
            _store_halves(v_cache_ptr, dst, v1, v2, v_scale, k_mask, HALF, FP8, FP8_LIMIT)
    else:
        _store_halves(k_ptr, token * stride_kt + k_heads * stride_kh + cols, k1, k2, None, k_mask, HALF, False,
                      FP8_LIMIT)


ROPE_KERNEL = _rope_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


def apply_rope_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotated in place (unless written to the cache)
    cos_cache: torch.Tensor,  # [max_position, rot_dim / 2]
    sin_cache: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # (q_norm, k_norm) weights [head_dim]
    eps: float = 1e-6,
    write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (and returns them), after per-head RMSNorm where norm_weights are given. With
    `write`, the rotated k and write.v go into the paged cache instead (store_kv in the same launch; k is left as
    it came); this needs rot_dim == head_dim."""
    tokens, num_heads, head_dim = q.shape
    half = cos_cache.shape[1]
    if 2 * half > head_dim or k.shape[-1] != head_dim or k.shape[0] != tokens:
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)} and rot_dim {2 * half} do not fit")
    if (norm_weights is not None or write is not None) and 2 * half != head_dim:
        raise ValueError(f"rope with q/k norm or a cache write needs rot_dim == head_dim (head_dim {head_dim})")
    if norm_weights is not None and any(w.shape != (head_dim,) for w in norm_weights):
        raise ValueError(f"rope with q/k norm needs [head_dim] weights (head_dim {head_dim})")
    q_norm, k_norm = norm_weights if norm_weights is not None else (cos_cache, cos_cache)  # unread without NORM
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride() != sin_cache.stride() or cos_cache.stride(1) != 1:
        raise ValueError("rope needs head_dim contiguous in q and k, and cos/sin caches with the same row-major layout")
    fp8 = check_write(k, write) if write is not None else False
    if write is None:  # the cache arguments are unread
        v, k_cache, v_cache, slots, k_scale, v_scale = k, k, k, positions, cos_cache, cos_cache
        cache_strides = (0, 0, 0, 1)
    else:
        v, k_cache, v_cache, slots = write.v, write.k_cache, write.v_cache, write.slot_mapping
        k_scale, v_scale = (write.k_scale, write.v_scale) if fp8 else (cos_cache, cos_cache)  # unread without FP8
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1])
    if tokens:
        pdl = chained(q)
        _rope_kernel[(tokens,)](
            positions, q, k, cos_cache, sin_cache, q_norm, k_norm,
            v, k_cache, v_cache, slots, k_scale, v_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
            *cache_strides,
            num_heads, k.shape[1], eps,
            HALF=half, NORM=norm_weights is not None,
            BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half), STORE=write is not None, FP8=fp8, FP8_LIMIT=FP8_MAX,
            PDL=pdl, launch_pdl=pdl,
        )
    return q, k


def rope_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (out of place): rotate-half on the first rot_dim dims, float32 math."""
    cos = cos_cache[positions.long()].float().unsqueeze(1)  # [T, 1, half]
    sin = sin_cache[positions.long()].float().unsqueeze(1)
    half = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2, rest = x[..., :half].float(), x[..., half : 2 * half].float(), x[..., 2 * half :]
        return torch.cat(((x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest), dim=-1)

    return rotate(q), rotate(k)
