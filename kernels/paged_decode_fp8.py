"""The paged decode kernel's other loops over an FP8 (e4m3) cache (kernels/paged_decode.py picks one by
FP8_DECODE_VARIANTS): each returns (m, l, acc) for the program's query heads, as the plain loop does.

Why several: over e4m3 tiles the plain loop (load, widen to fp16, the bf16 kernel's two tensor-core products)
measured at about half the bytes/s of the bf16 kernel on an H200, taking as long per key as bf16 does for twice the
bytes. These loops change how the tiles meet the products, so one GPU run can time them side by side.
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
def fp8_transposed_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp, stride_ch,
                        block_size, scale_log2e, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        DOT_FP16: tl.constexpr):
    """The widened e4m3 tiles as the first operand of both products (s^T = k q^T, acc^T = v^T p^T), the operand a
    tensor-core product may take from registers: the converted tile need not go back through shared memory."""
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < HEAD_DIM
    if DOT_FP16:
        q_t = tl.trans(tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16))  # [BLOCK_D, BLOCK_G]
    else:
        q_t = tl.trans(q)
    m = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        k, v, valid = load_tiles(k_cache_ptr, v_cache_ptr, table, tile_start, end, kv_head, stride_cb, stride_cp,
                                  stride_ch, block_size, d, dim_ok, BLOCK_N)
        k, v = k.to(q_t.dtype), v.to(q_t.dtype)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_N, BLOCK_G]
        s_t = tl.where(valid[:, None], s_t, NEG_BIG)
        m_new = tl.maximum(m, tl.max(s_t, 0))
        p_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(q_t.dtype), input_precision=DOT_PRECISION)
        m = m_new
    return m, l, tl.trans(acc_t)


@triton.jit
def fp8_k_transposed_load_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp,
                               stride_ch, block_size, scale_log2e, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               DOT_FP16: tl.constexpr):
    """The plain loop with K loaded straight into its [head_dim, keys] shape: load -> widen -> product, with no
    transpose between (the shape the compiler's mixed-precision operand path handles)."""
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < HEAD_DIM
    if DOT_FP16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m, l, acc = start_state(BLOCK_G, BLOCK_D)
    for tile_start in range(start, end, BLOCK_N):
        kv_off, valid = _tile_offsets(table, tile_start, end, kv_head, stride_cb, stride_cp, stride_ch, block_size,
                                      BLOCK_N)
        k_t = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=valid[None, :] & dim_ok[:, None],
                      other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None] & dim_ok[None, :],
                    other=0.0).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2e
        p, alpha, m_new, l = softmax_step(s, valid, m, l)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def fp8_fma_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp, stride_ch,
                 block_size, scale_log2e, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """No tensor cores: float32 multiply-adds on the widened tiles, over the query heads of this KV head only
    (BLOCK_G = the group rounded to a power of two, not padded to 16 rows). A decode step does ~2 x group
    multiply-adds per cached element, which CUDA cores do faster than an H200 reads e4m3 for small groups."""
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < HEAD_DIM
    qf = q.to(tl.float32)
    m, l, acc = start_state(BLOCK_G, BLOCK_D)
    for tile_start in range(start, end, BLOCK_N):
        k, v, valid = load_tiles(k_cache_ptr, v_cache_ptr, table, tile_start, end, kv_head, stride_cb, stride_cp,
                                  stride_ch, block_size, d, dim_ok, BLOCK_N)
        k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.sum(qf[:, None, :] * k[None, :, :], 2) * scale_log2e  # [BLOCK_G, BLOCK_N]
        p, alpha, m_new, l = softmax_step(s, valid, m, l)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m = m_new
    return m, l, acc


@triton.jit
def fp8_e4m3_loop(q, k_cache_ptr, v_cache_ptr, table, start, end, kv_head, stride_cb, stride_cp, stride_ch,
                  block_size, scale_log2e, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, E4M3_PV: tl.constexpr):
    """e4m3 products on the tensor cores: the tiles go from memory to the products as stored, never widened.
    The query is quantized to e4m3 with one scale for the program's heads (their largest magnitude -> 448; the
    scale folds into the softmax scale). E4M3_PV: the probabilities too, as p x 448 (their largest value in a
    row is 1, so the whole e4m3 range is used; the 448 comes off at the end); else p and V meet as fp16.
    Returns (m, l, acc) like the other loops; l sums the unrounded probabilities."""
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < HEAD_DIM
    qf = q.to(tl.float32)
    q_scale = tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), 1e-30) / 448.0
    q8 = (qf / q_scale).to(tl.float8e4nv)
    scale_log2e = scale_log2e * q_scale
    m, l, acc = start_state(BLOCK_G, BLOCK_D)
    for tile_start in range(start, end, BLOCK_N):
        k, v, valid = load_tiles(k_cache_ptr, v_cache_ptr, table, tile_start, end, kv_head, stride_cb, stride_cp,
                                  stride_ch, block_size, d, dim_ok, BLOCK_N)
        s = tl.dot(q8, tl.trans(k)) * scale_log2e  # [BLOCK_G, BLOCK_N], log2 domain
        p, alpha, m_new, l = softmax_step(s, valid, m, l)
        if E4M3_PV:
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), v)
        else:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv
        m = m_new
    if E4M3_PV:
        acc = acc * (1.0 / 448.0)
    return m, l, acc


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
        # both tiles widened before the products: widening V after the softmax took 166 registers instead of 128
        # (bench/kernel_asm.py), and a kernel of that build ran 1.3x slower at 64 x 4,096 on an H200
        k_even, k_odd = widen_pairs_tile(tl.load(k_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0), ASM)
        v_even, v_odd = widen_pairs_tile(tl.load(v_cache_ptr + kv_off[:, None] + j[None, :], mask=mask, other=0), ASM)
        s = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even))) * scale_log2e
        p, alpha, m, l = softmax_step(s, valid, m, l)
        p16 = p.to(tl.float16)
        acc_even = tl.dot(p16, v_even, acc_even * alpha[:, None])
        acc_odd = tl.dot(p16, v_odd, acc_odd * alpha[:, None])
    return m, l, join_dims(acc_even, acc_odd, BLOCK_G, BLOCK_D)
