"""The paged decode kernel's loop over an FP8 (e4m3) cache read as int16 pairs (kernels/paged_decode.py takes it
for the "pairs" variant, kernels/kv_fp8.py: FP8_DECODE_VARIANTS), and the tile helpers it shares with the plain
loop. It returns (m, l, acc) for the program's query heads, as the plain loop does.

Why: over e4m3 tiles the plain loop (load, widen to fp16, the bf16 kernel's two tensor-core products) took about
as long per key as bf16 does for twice the bytes, as Triton reads an e4m3 tile back from shared memory a byte at a
time; as int16 pairs the tiles move as bf16 tiles do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardserve.kernels.attention_common import NEG_BIG
from shardserve.kernels.fp8_pairs import join_dims, split_query, widen_pairs_tile


@triton.jit
def _tile_offsets(table, tile_start, end, kv_head, stride_cb, stride_cp, stride_ch, block_size, BLOCK_N: tl.constexpr):
    pos = tile_start + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % block_size) * stride_cp + kv_head * stride_ch, valid


@triton.jit
def load_tiles(k_cache_ptr, v_cache_ptr, table, tile_start, end, kv_head, stride_cb, stride_cp, stride_ch,
                block_size, d, dim_ok, BLOCK_N: tl.constexpr):
    """One tile's K and V [BLOCK_N, BLOCK_D] as stored (e4m3; zeros past the context) and which keys are valid."""
    kv_off, valid = _tile_offsets(table, tile_start, end, kv_head, stride_cb, stride_cp, stride_ch, block_size, BLOCK_N)
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v, valid


@triton.jit
def start_state(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The online softmax before any key: running max m and sum l per row, and the [ROWS, COLS] accumulator."""
    return (tl.full([ROWS], NEG_BIG, dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
            tl.zeros([ROWS, COLS], dtype=tl.float32))


@triton.jit
def softmax_step(s, valid, m, l):
    """One tile's online-softmax update over scores s [rows, keys] (log2 domain; keys past the context masked):
    returns (p, alpha, m_new, l_new), where the caller scales its accumulator by alpha and adds p's product."""
    s = tl.where(valid[None, :], s, NEG_BIG)
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def fp8_pairs_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp, stride_ch,
                   block_size, scale_log2e, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """The e4m3 cache read as int16 pairs (kernels/fp8_pairs.py; the caches and strides given as int16 views): to
    the memory pipeline an FP8 tile of N keys is a 16-bit tile of N keys x head_dim / 2, which Triton copies and
    loads as it does bf16 (an e4m3 tile it reads back from shared memory a byte at a time)."""
    HALF: tl.constexpr = BLOCK_D // 2
    j = tl.arange(0, HALF)
    pair_ok = j < HEAD_DIM // 2
    q_even, q_odd = split_query(q, BLOCK_G, BLOCK_D)
    m, l, acc_even = start_state(BLOCK_G, HALF)
    acc_odd = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        kv_off, valid = _tile_offsets(table, tile_start, end, kv_head, stride_cb, stride_cp, stride_ch, block_size,
                                      BLOCK_N)
        mask = valid[:, None] & pair_ok[None, :]
        # both tiles widened before the products: widening V after the softmax took more registers a program
        # (bench/kernel_asm.py) and ran slower
        k_even, k_odd = widen_pairs_tile(tl.load(k_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0), ASM)
        v_even, v_odd = widen_pairs_tile(tl.load(v_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0), ASM)
        s = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even))) * scale_log2e
        p, alpha, m, l = softmax_step(s, valid, m, l)
        p16 = p.to(tl.float16)
        acc_even = tl.dot(p16, v_even, acc_even * alpha[:, None])
        acc_odd = tl.dot(p16, v_odd, acc_odd * alpha[:, None])
    return m, l, join_dims(acc_even, acc_odd, BLOCK_G, BLOCK_D)
