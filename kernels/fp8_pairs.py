"""An FP8 (e4m3) KV cache read as int16 pairs, for the decode kernel's tensor-core products.

Triton 3.6 reads an e4m3 tile that feeds a product back from shared memory a byte at a time (128 one-byte loads
per thread per 128-key tile of the decode kernel), which held the FP8 decode kernel at about the bf16 kernel's
time for half the bytes. Read as int16 (two e4m3 of adjacent dims each), the same tile moves as a 16-bit tile of
half the width: asynchronous 16-byte copies into shared memory and matrix loads out of it, as bf16 does. Each
int16 then widens exactly into two fp16 values, an even dim and an odd dim. The products need no interleaving:
q . k sums over the dims in any order (s = q_even . k_even + q_odd . k_odd), and p . v gives the output's even
and odd dims separately, joined once at the end. The caller passes the caches as int16 views (and their strides).
(The prefill/extend kernel keeps widening e4m3 tiles: its 64-row products take Hopper's warpgroup instructions,
for which Triton reads e4m3 from shared memory in 16-byte loads; pairs there measured the same.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def widen_pairs_tile(x, ASM: tl.constexpr):
    """x: int16 holding two e4m3 (low byte: the even dim) -> (even, odd) as fp16, exactly. ASM (compiled, sm_89+):
    per two elements (one 32-bit register, four bytes), two native e4m3x2 -> f16x2 conversions and two byte
    permutes that regroup the halves into the even and the odd tensor. Else (Triton's interpreter) the same values
    by bit moves: the e4m3 bits go into fp16's (sign to sign, exponent and mantissa to the bits below, where the
    exponent bias is 8 more, hence x 256). The saturating cache never holds e4m3's NaN."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            prmt.b32 $0, a, b, 0x5410;
            prmt.b32 $1, a, b, 0x7632;
            }""",
            constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        x = x.to(tl.int32) & 0xFFFF
        even = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
        odd = ((x & 0x8000) | ((x >> 1) & 0x3F80)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return even, odd


@triton.jit
def split_query(q, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """q [ROWS, BLOCK_D] -> its even and odd dims as fp16 (clamped to fp16's range), [ROWS, BLOCK_D // 2] each."""
    q16 = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return tl.split(tl.reshape(q16, [ROWS, BLOCK_D // 2, 2]))


@triton.jit
def join_dims(acc_even, acc_odd, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The even and odd output dims back into one [ROWS, BLOCK_D] tile."""
    return tl.reshape(tl.join(acc_even, acc_odd), [ROWS, BLOCK_D])


COMPILED = os.environ.get("TRITON_INTERPRET") != "1"  # inline PTX only where the kernels compile, not interpreted


@triton.jit
def _widen_pairs_kernel(x_ptr, even_ptr, odd_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    even, odd = widen_pairs_tile(tl.load(x_ptr + i, mask=i < n, other=0), ASM)
    tl.store(even_ptr + i, even, mask=i < n)
    tl.store(odd_ptr + i, odd, mask=i < n)


def widen_pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """widen_pairs_tile alone over a flat int16 tensor (the decode loop's widening, for tests): (even, odd) fp16, the
    inline-PTX path where the kernels compile, the bit moves in Triton's interpreter."""
    even, odd = (torch.empty(x.shape, dtype=torch.float16, device=x.device) for _ in range(2))
    block = 1024
    _widen_pairs_kernel[(triton.cdiv(x.numel(), block),)](x, even, odd, x.numel(), BLOCK=block, ASM=COMPILED)
    return even, odd
