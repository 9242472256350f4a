"""Triton paged decode attention: one query token per sequence, GQA-aware, split-K over long contexts.

Each program owns one (sequence, KV head, split): it loads the split's K/V tiles once and attends the whole
group of query heads that share that KV head (padded to 16 rows so the tile products run on tensor cores).
With more than one split, each writes a normalised partial output and its log-sum-exp, and a second kernel
merges the splits. Split ranges are computed on the device from seq_lens, so a fixed num_splits is correct
for any context length (what CUDA-graph replay needs); it only changes how the work is spread.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shardserve.kernels.fp8_pairs import COMPILED
from shardserve.kernels.kv_fp8 import FP8_DECODE_VARIANTS, dequantize_fp8
from shardserve.kernels.pdl import chained, start_as_dependent

from shardserve.kernels.attention_common import LOG2E, NEG_BIG, check_paged_inputs, check_scales, dot_precision
from shardserve.kernels.paged_decode_fp8 import fp8_pairs_loop, load_tiles, softmax_step, start_state


# The block table's row stride is the step's widest table: left unspecialised, or each new value that is (not) a
# multiple of 16 compiles another variant in the middle of serving (~1 s for this kernel).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_bt,
    block_size: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr, PAIRS: tl.constexpr, DOT_FP16: tl.constexpr,
    ASM: tl.constexpr = False, PDL: tl.constexpr = False, ORDERED: tl.constexpr = False,
):
    """Grid (num_seqs * num_kv_heads, NUM_SPLITS). Program (s * num_kv_heads + h, j) attends the query heads
    h*GROUP .. h*GROUP+GROUP-1 of sequence s to its context positions in split j (a run of whole BLOCK_N tiles).
    A sequence's KV heads are launched next to each other, so they read the same cache blocks (each head is a
    256-byte slice of every token's row) at about the same time (as fast as separate grid axes; one order kept).
    FP8: the cache holds float8 e4m3; the program's KV head's K scale folds into the softmax scale, its V scale
    into the output. PAIRS: the cache read as int16 pairs of e4m3 (kernels/kv_fp8.py, FP8_DECODE_VARIANTS); else
    the tiles are widened and DOT_FP16 makes 16-bit operands fp16 (e4m3 -> fp16 is one native conversion; q is
    clamped to fp16's range).
    block_size is a compile-time constant: a position's block and slot by shifts (12% fewer instructions than by
    division, compiled for sm_90). PDL: launched as a programmatic dependent (kernels/pdl.py).
    ORDERED: program row s attends sequence order_ptr[s] instead of s (the GPU starts programs about in grid order,
    so an order longest first leaves short programs, not long ones, for the end of a batch of unequal contexts)."""
    if PDL:
        start_as_dependent()
    seq = tl.program_id(0) // NUM_KV_HEADS
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    m, l, acc = start_state(BLOCK_G, BLOCK_D)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if FP8:
        scale_log2e = scale_log2e * tl.load(k_scale_ptr + kv_head)
    if PAIRS:  # (PAIRS and DOT_FP16 are False without FP8)
        m, l, acc = fp8_pairs_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp,
                                   stride_ch, block_size, scale_log2e, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, ASM)
    else:
        if DOT_FP16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        for tile_start in range(start, end, BLOCK_N):
            k, v, valid = load_tiles(k_cache_ptr, v_cache_ptr, table, tile_start, end, kv_head, stride_cb, stride_cp,
                                     stride_ch, block_size, d, dim_ok, BLOCK_N)
            if FP8:  # e4m3 -> bf16/fp16/fp32 is exact
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_G, BLOCK_N], log2
            p, alpha, m, l = softmax_step(s, valid, m, l)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    has_keys = l > 0.0
    result = acc / tl.where(has_keys, l, 1.0)[:, None]
    if FP8:
        result = result * tl.load(v_scale_ptr + kv_head)
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: part_out [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM], part_lse [num_seqs, num_heads, NUM_SPLITS]
        row = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], result, mask=out_mask)
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), NEG_BIG)
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


DECODE_KERNEL = _decode_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (num_seqs, num_heads). Merges one head's split partials by their log-sum-exp (log2 domain). PDL: as
    the decode kernel."""
    if PDL:
        start_as_dependent()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    split_ok = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row0 + splits, mask=split_ok, other=NEG_BIG)
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = tl.where(split_ok, weight, 0.0)
    parts = tl.load(part_out_ptr + (row0 + splits)[:, None] * HEAD_DIM + d[None, :],
                    mask=split_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Launch settings per cache (keys per tile, warps, pipeline stages, stages where a context is one split and the
# launch small), head_dim <= 128. An e4m3 tile of 128 keys moves the bytes of a bf16 tile of 64 (the loop's fixed
# costs, the two products and the softmax, are paid per tile, so half-size FP8 tiles left the kernel far below the
# copy rate). bf16 takes a third stage where each program reads a whole context (one split) and the launch has at
# most DEEP_MAX_PROGRAMS programs: faster there, slower with more programs (three stages fit 2 programs an SM, two
# stages 3) and for split launches.
DECODE_LAUNCH = {"bf16": (64, 4, 2, 3), "fp8": (128, 4, 2, 2)}
DEEP_MAX_PROGRAMS = 1024


def decode_launch(fp8: bool, head_dim: int, num_splits: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) the decode kernel uses by default for this cache and head size, for a
    launch of `programs` programs (sequences x KV heads x splits) over num_splits splits."""
    block_n, warps, stages, one_split_stages = DECODE_LAUNCH["fp8" if fp8 else "bf16"]
    if triton.next_power_of_2(head_dim) > 128:
        block_n = max(32, block_n // 2)
    deep = num_splits == 1 and programs <= DEEP_MAX_PROGRAMS
    return block_n, warps, one_split_stages if deep else stages


TARGET_PROGRAMS = 528  # programs the split-K decode aims for: ~4 per SM of an H200 (132 SMs)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, target_programs: int | None = None,
                      min_tokens_per_split: int = 64, max_splits: int = 16) -> int:
    """Enough programs for ~4 per SM of an H200 (132 SMs), never a split shorter than one 64-key tile: a small
    batch needs splits to fill the GPU, a large one is fastest unsplit (extra splits cost a second launch and
    partial writes)."""
    by_length = max(1, math.ceil(max_seq_len / min_tokens_per_split))
    by_occupancy = max(1, (target_programs or TARGET_PROGRAMS) // max(1, num_seqs * num_kv_heads))
    return max(1, min(max_splits, by_length, by_occupancy))


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    block_n: int | None = None,  # None: decode_launch's (with num_warps, num_stages)
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32: an FP8 cache's scales
    v_scale: torch.Tensor | None = None,
    fp8_variant: str | None = None,  # FP8_DECODE_VARIANTS; None: "pairs" ("fp16" for float32 queries)
    block_g: int | None = None,  # rows of the products (the group padded); None: the fewest the loop can take
    order: torch.Tensor | None = None,  # [num_seqs] int32, a permutation: the order the sequences' programs start in
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, group = check_paged_inputs(q, k_cache, v_cache)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    if fp8_variant is not None and fp8_variant not in FP8_DECODE_VARIANTS:
        raise ValueError(f"fp8_variant must be one of {', '.join(FP8_DECODE_VARIANTS)}; got {fp8_variant!r}")
    # float32 queries: products in float32 (fp16 pairs would round them)
    pairs = fp8 and (fp8_variant or "pairs") == "pairs" and q.dtype != torch.float32
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused when NUM_SPLITS == 1
    block_d = triton.next_power_of_2(head_dim)
    default_n, default_warps, default_stages = decode_launch(fp8, head_dim, num_splits,
                                                            num_seqs * num_kv_heads * num_splits)
    if pairs:  # the e4m3 cache as int16 pairs (fp8_pairs_loop)
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
    pdl = chained(q)
    _decode_kernel[(num_seqs * num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if order is None else order,  # unread unless ORDERED
        out, part_out, part_lse,
        k_scale if fp8 else q, v_scale if fp8 else q,  # unused without FP8
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1],
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_G=block_g or max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n or default_n, DOT_PRECISION=dot_precision(q.dtype),
        NUM_KV_HEADS=num_kv_heads, FP8=fp8, PAIRS=pairs, DOT_FP16=fp8 and q.dtype != torch.float32,
        ASM=COMPILED, PDL=pdl, ORDERED=order is not None,
        num_warps=num_warps or default_warps, num_stages=num_stages or default_stages, launch_pdl=pdl,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            PDL=pdl, launch_pdl=pdl,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: per sequence, gather its context from the blocks and attend in float32 (an FP8 cache
    dequantized with its scales first)."""
    if k_scale is not None:
        k_cache, v_cache = dequantize_fp8(k_cache, k_scale, torch.float32), dequantize_fp8(v_cache, v_scale, torch.float32)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(num_seqs):
        length = int(seq_lens[i])
        blocks = block_tables[i, : -(-length // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, heads, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out
