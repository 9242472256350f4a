"""Triton varlen causal attention over the paged KV cache: prefills, chunks, prefix-cache extends, and decodes.

A batch is B sequences packed along T tokens (query_start_loc = cu_seqlens_q). Sequence i has q_len new
tokens and context seq_len (cached prefix + new tokens, already written by store_kv); its query j sits at
position seq_len - q_len + j and sees keys 0 ..= that position. Decodes are q_len 1, so one launch serves
a mixed prefill + decode batch.

Each program owns one tile of BLOCK_Q query tokens of one sequence and one KV head; its BLOCK_M rows are
(token, query head of the group) pairs, so each K/V tile is read once for the whole GQA group.
Its defaults (block_m 64, 4 warps, 2 stages) run a long causal prefill at about half the rate of torch SDPA's dense
flash kernel on the same shape (docs/performance-history.md).
Tiles are numbered without a host-side list: sequence i's tiles start at query_start_loc[i] // BLOCK_Q + i
(this bound never overlaps the next sequence), and a program finds its sequence by binary search.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.attention_common import LOG2E, NEG_BIG, check_paged_inputs, check_scales, dot_precision
from shardserve.kernels.kv_fp8 import dequantize_fp8


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i with query_start_loc[i] // BLOCK_Q + i <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_kv_tile(q, q_pos, m, l, acc, tile_start, last_q_pos, table, k_cache_ptr, v_cache_ptr,
                    kv_head, stride_cb, stride_cp, stride_ch, block_size, scale_log2e,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step over keys tile_start .. tile_start + BLOCK_N - 1. Without CAUSAL every row sees
    every key of the tile (keys before the query tile's first position), so loads and scores go unmasked."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    valid = pos <= last_q_pos
    if CAUSAL:
        block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // block_size).to(tl.int64)
    kv_off = (block * stride_cb + (pos % block_size) * stride_cp + kv_head * stride_ch)[:, None] + d[None, :]
    if CAUSAL or HEAD_DIM != BLOCK_D:
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    if FP8:  # e4m3 -> bf16/fp32 is exact; the scales are folded in by the caller
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N], log2 domain
    if CAUSAL:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, NEG_BIG)
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


# num_seqs: a batch of 1 must not compile a constexpr bound; stride_bt: see paged_decode.py
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_bt,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """Grid (T // BLOCK_Q + B, num_kv_heads). Program (t, h): query tile t (of some sequence) x KV head h.
    FP8: the KV head's K scale folds into the softmax scale, its V scale into the output."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_start = seq_len - q_len  # position of the sequence's first new token

        rows = tl.arange(0, BLOCK_M)
        tok = local_tile * BLOCK_Q + rows // GROUP  # query index within the sequence
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows // GROUP < BLOCK_Q) & (tok < q_len)
        d = tl.arange(0, BLOCK_D)
        dim_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q_pos = context_start + tok  # [BLOCK_M]

        m = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if FP8:
            scale_log2e = scale_log2e * tl.load(k_scale_ptr + kv_head)
        first_q_pos = context_start + local_tile * BLOCK_Q
        last_q_pos = context_start + tl.minimum((local_tile + 1) * BLOCK_Q, q_len) - 1
        # keys before the tile's first query are seen by every row: no causal mask needed there
        unmasked_end = (first_q_pos // BLOCK_N) * BLOCK_N
        for tile_start in range(0, unmasked_end, BLOCK_N):
            m, l, acc = _attend_kv_tile(q, q_pos, m, l, acc, tile_start, last_q_pos, table, k_cache_ptr, v_cache_ptr,
                                        kv_head, stride_cb, stride_cp, stride_ch, block_size, scale_log2e,
                                        HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_PRECISION, FP8)
        for tile_start in range(unmasked_end, last_q_pos + 1, BLOCK_N):
            m, l, acc = _attend_kv_tile(q, q_pos, m, l, acc, tile_start, last_q_pos, table, k_cache_ptr, v_cache_ptr,
                                        kv_head, stride_cb, stride_cp, stride_ch, block_size, scale_log2e,
                                        HEAD_DIM, BLOCK_D, BLOCK_N, True, DOT_PRECISION, FP8)

        result = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        if FP8:
            result = result * tl.load(v_scale_ptr + kv_head)
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this step
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, group = check_paged_inputs(q, k_cache, v_cache)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if tokens == 0:
        return out
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    grid = (tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        k_scale if fp8 else q, v_scale if fp8 else q,  # unused without FP8
        num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1],
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n or (64 if block_d <= 128 else 32),
        DOT_PRECISION=dot_precision(q.dtype), FP8=fp8, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: per sequence, gather its context and attend in float32 with the offset causal mask
    (an FP8 cache dequantized with its scales first)."""
    if k_scale is not None:
        k_cache, v_cache = dequantize_fp8(k_cache, k_scale, torch.float32), dequantize_fp8(v_cache, v_scale, torch.float32)
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(seq_lens.shape[0]):
        start, end, length = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        blocks = block_tables[i, : -(-length // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float().repeat_interleave(group, 1)
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out
