"""Triton rotary position embedding, neox style (rotate-half), applied in place to q and k; optionally with
Qwen3's per-head RMSNorm of q and k fused in front (one launch instead of three).

Cache layout (matches worker/layers/rotary.py): cos_cache and sin_cache, each [max_position, rot_dim / 2],
float32, indexed by position. The first rot_dim dims of each head are rotated (rot_dim = 2 * cache width, at
most head_dim; equal to it for Llama/Qwen): with x1, x2 the two halves,
out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin, computed in float32 and rounded once.
With norm weights, each head is first normalised as worker/layers/norm.py does (float32 statistics, rounded to
the model dtype, times the weight, rounded again); this needs rot_dim == head_dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, w_ptr, token, stride_t, stride_h, num_heads, cos, sin, eps,
                  HALF: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    first = x_ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm over the whole head (rot_dim == head_dim = 2 * HALF)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * w1
        x2 = (x2 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * w2
        x1 = x1.to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    num_q_heads, num_k_heads, eps,
    HALF: tl.constexpr, NORM: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (T,). Program t (normalises and) rotates every q and k head of token t by the angles of positions[t]."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_norm_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, eps,
                  HALF, NORM, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, k_norm_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, eps,
                  HALF, NORM, BLOCK_KH, BLOCK_HALF)


def apply_rope_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotated in place
    cos_cache: torch.Tensor,  # [max_position, rot_dim / 2]
    sin_cache: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # (q_norm, k_norm) weights [head_dim]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (and returns them), after per-head RMSNorm where norm_weights are given."""
    tokens, num_heads, head_dim = q.shape
    half = cos_cache.shape[1]
    if 2 * half > head_dim or k.shape[-1] != head_dim or k.shape[0] != tokens:
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)} and rot_dim {2 * half} do not fit")
    if norm_weights is not None and (2 * half != head_dim or any(w.shape != (head_dim,) for w in norm_weights)):
        raise ValueError(f"rope with q/k norm needs rot_dim == head_dim and [head_dim] weights (head_dim {head_dim})")
    q_norm, k_norm = norm_weights if norm_weights is not None else (cos_cache, cos_cache)  # unread without NORM
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride() != sin_cache.stride() or cos_cache.stride(1) != 1:
        raise ValueError("rope needs head_dim contiguous in q and k, and cos/sin caches with the same row-major layout")
    if tokens:
        _rope_kernel[(tokens,)](
            positions, q, k, cos_cache, sin_cache, q_norm, k_norm,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
            num_heads, k.shape[1], eps,
            HALF=half, NORM=norm_weights is not None,
            BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half),
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
