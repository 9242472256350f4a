"""The paged decode kernel with two (sequence, KV head) items a program, for batches that need no split.

Why: a program of the one-item kernel (paged_decode.py) starts with a chain of dependent reads before its first
K/V byte arrives (the order entry, the context length, the block table, then the tile), and a batch of short
contexts is many short programs, each paying that chain once: on an H200 an FP8 cache read at 81% of the copy
rate at 256 x 800 keys (7 tiles a program) but 92% at 64 x 4,096 (32 tiles). Here program p attends item p and
item n - 1 - p (n = sequences x KV heads, in the launch order: longest context first where an order is given, so
the longest item shares a program with the shortest and the programs take about equal time). Both items' lengths
and queries are read at the start, and the tiles of both run as one loop, so the pipeline fetches the second
item's first tiles while the first item's last ones are in the products: the chain is paid once per two items.

Each item's output is written when its last tile is in (a masked store in the loop), and the softmax state starts
again for the next. An item with no keys (a padding row of a CUDA graph) still takes one fully masked tile, so
its output is written, as zeros, like the one-item kernel's. Only the loops the decode uses by default: bf16 (and
fp32) caches, and an FP8 cache read as int16 pairs (paged_decode_fp8.fp8_pairs_loop).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardserve.kernels.attention_common import NEG_BIG
from shardserve.kernels.fp8_pairs import split_query, widen_pairs_tile
from shardserve.kernels.paged_decode_fp8 import _tile_offsets, softmax_step
from shardserve.kernels.pdl import start_as_dependent


@triton.jit
def _item(item, order_ptr, seq_lens_ptr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, ORDERED: tl.constexpr):
    """(sequence, KV head, context length, tiles >= 1) of launch item `item`."""
    seq = item // NUM_KV_HEADS
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    length = tl.load(seq_lens_ptr + seq)
    return seq, item % NUM_KV_HEADS, length, tl.maximum(tl.cdiv(length, BLOCK_N), 1)


@triton.jit(do_not_specialize=["stride_bt", "num_items"])
def _paired_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2e, num_items,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch, stride_bt,
    block_size: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr,
    ASM: tl.constexpr = False, PDL: tl.constexpr = False, ORDERED: tl.constexpr = False,
):
    """Grid (cdiv(num_items, 2),), num_items = num_seqs * NUM_KV_HEADS; item i is KV head i % NUM_KV_HEADS of
    sequence i // NUM_KV_HEADS (of order_ptr[that] where ORDERED). Program p attends items p and num_items - 1 - p
    (the middle program of an odd count, one item). FP8: the caches are int16 views of an e4m3 cache (strides in
    int16 elements), each KV head's K scale folded into its softmax scale and its V scale into its output."""
    if PDL:
        start_as_dependent()
    item_a = tl.program_id(0)
    item_b = num_items - 1 - item_a
    seq_a, head_a, len_a, tiles_a = _item(item_a, order_ptr, seq_lens_ptr, NUM_KV_HEADS, BLOCK_N, ORDERED)
    seq_b, head_b, len_b, tiles_b = _item(item_b, order_ptr, seq_lens_ptr, NUM_KV_HEADS, BLOCK_N, ORDERED)
    tiles_b = tl.where(item_b > item_a, tiles_b, 0)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head_ok = g < GROUP
    q_mask = head_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_a = tl.load(q_ptr + seq_a * stride_qt + (head_a * GROUP + g)[:, None] * stride_qh + d[None, :], mask=q_mask,
                  other=0.0)
    q_b = tl.load(q_ptr + seq_b * stride_qt + (head_b * GROUP + g)[:, None] * stride_qh + d[None, :], mask=q_mask,
                  other=0.0)
    scale_a = scale_log2e
    scale_b = scale_log2e
    if FP8:
        scale_a = scale_log2e * tl.load(k_scale_ptr + head_a)
        scale_b = scale_log2e * tl.load(k_scale_ptr + head_b)
        v_scale_a = tl.load(v_scale_ptr + head_a)
        v_scale_b = tl.load(v_scale_ptr + head_b)

    # FP8: the products over the even and the odd dims (fp8_pairs.py); else over all dims, as HALF = BLOCK_D
    HALF: tl.constexpr = BLOCK_D // 2 if FP8 else BLOCK_D
    j = tl.arange(0, HALF)
    col_ok = j < (HEAD_DIM // 2 if FP8 else HEAD_DIM)
    if FP8:
        q_a, q_a_odd = split_query(q_a, BLOCK_G, BLOCK_D)
        q_b, q_b_odd = split_query(q_b, BLOCK_G, BLOCK_D)
    m = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)  # (FP8 only)
    total = tiles_a + tiles_b
    for t in range(0, total):
        in_a = t < tiles_a
        seq = tl.where(in_a, seq_a, seq_b)
        head = tl.where(in_a, head_a, head_b)
        kv_off, valid = _tile_offsets(block_tables_ptr + seq.to(tl.int64) * stride_bt,
                                      tl.where(in_a, t, t - tiles_a) * BLOCK_N, tl.where(in_a, len_a, len_b), head,
                                      stride_cb, stride_cp, stride_ch, block_size, BLOCK_N)
        mask = valid[:, None] & col_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0)
        if FP8:
            k, k_odd = widen_pairs_tile(k, ASM)
            v, v_odd = widen_pairs_tile(v, ASM)
            s = tl.dot(tl.where(in_a, q_a_odd, q_b_odd), tl.trans(k_odd),
                       tl.dot(tl.where(in_a, q_a, q_b), tl.trans(k)))
        else:
            s = tl.dot(tl.where(in_a, q_a, q_b), tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, m, l = softmax_step(s * tl.where(in_a, scale_a, scale_b), valid, m, l)
        p = p.to(v.dtype)
        if FP8:  # (each loop's own form of the update: the one-item kernel's results, bit for bit)
            acc = tl.dot(p, v, acc * alpha[:, None])
            acc_odd = tl.dot(p, v_odd, acc_odd * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)

        # the item's last tile: write its output, start the softmax again for the next item
        if (t == tiles_a - 1) | (t == total - 1):
            total_l = tl.where(l > 0.0, l, 1.0)[:, None]
            out = out_ptr + seq * stride_ot + (head * GROUP + g)[:, None] * stride_oh
            out_mask = head_ok[:, None] & col_ok[None, :]
            if FP8:  # even dims at 2j, odd at 2j + 1
                v_scale = tl.where(in_a, v_scale_a, v_scale_b)
                tl.store(out + 2 * j[None, :], (acc / total_l * v_scale).to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(out + 2 * j[None, :] + 1, (acc_odd / total_l * v_scale).to(out_ptr.dtype.element_ty),
                         mask=out_mask)
                acc_odd = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
            else:
                tl.store(out + j[None, :], (acc / total_l).to(out_ptr.dtype.element_ty), mask=out_mask)
            m = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
            l = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)

PAIRED_DECODE_KERNEL = _paired_decode_kernel  # for bench/kernel_asm.py
