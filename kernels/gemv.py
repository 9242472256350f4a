"""Triton GEMV for decode at batch 1-4: y = x W^T with W [N, K] read once, at the copy rate.

At M = 1 the matmul is a pass over the weight. cuBLAS picks 64-wide tiles and split-K for Llama-3-8B's qkv
(6,144 x 4,096) and o_proj (4,096 x 4,096), which reads them well below the copy rate. Here each program owns
BLOCK_N output columns and walks K in BLOCK_K steps, every row of x against the same weight tile (loaded once,
coalesced along K), accumulating in float32; SPLIT_K > 1 gives each program 1/SPLIT_K of K and adds its partial
sums into a float32 buffer with atomics (for shapes with few columns).

The layer's small kernels can ride along (gemv_fused), so a one-row decoder layer is four GEMVs and its attention:
- norm: x is the residual stream and the GEMV reads RMSNorm(x) * weight (each program normalises the row itself;
  it is a few KB in L2 against the MBs of weight it streams),
- silu: x is the merged gate_up output [M, 2K] and the GEMV reads silu(gate) * up,
- residual: the output is x W^T + residual, the new residual stream.
Each is rounded exactly as the separate kernels round (kernels/rmsnorm.py, activation.py), so the fused layer
computes what the unfused one does.

FP8 weights (`quantization="fp8"`, kernels/fp8_linear.py): W is e4m3 [N, K] with a float32 scale per output
channel; each weight tile is widened in registers (exactly) and the sum over K multiplied by the column's scale.
x stays in the model's dtype (W8A16): at one row the product is a pass over the weight, so quantizing x would buy
no speed and only add its rounding. An already quantized x (Fp8Rows, where RMSNorm hands one over: TP > 1) is read
as it is, its row scale applied with the weight's. A one-row step then reads about half the bytes of bf16 weights.

On Hopper a one-pass GEMV is launched as a programmatic dependent of the kernel before it (PDL): its programs may
start while that kernel finishes and load their first weight tile, then wait (griddepcontrol.wait) before reading x.
Everything it writes comes after the wait, and every program waits, so the kernel after it sees all before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from shardserve.kernels.kv_fp8 import FP8_DTYPE
from shardserve.kernels.pdl import supported as pdl_supported

MAX_ROWS = 4
# The one-row layer's GEMVs sum their products lane by lane and keep the weight tile out of shared memory (the
# kernel's FLAT): faster where the GEMV reads x through the norm or SiLU or adds a residual, slower for the plain
# GEMV (the LM head at batch 1), so "auto" takes it for those reads only. "0" and "1" (none, every one-row GEMV)
# are for the tests and timing scripts that compare the two.
FLAT = "auto"
# e4m3 weights are read this many elements at a time (_weight_tile's VEC), x being in the model's dtype: 8 lays the
# tile out as x's bf16 tile is, so the products need no re-layout of x through shared memory.
FP8_VEC = 8
# The FLAT GEMV over e4m3 weights sums each step's products this many at a time in the lane first: the running sums
# then take a GROUP-th of the registers, so more of the weight is in flight. Half-precision weights are not grouped
# (it made their GEMVs slower).
FP8_GROUP = 8


def _flat(m: int, norm: bool, silu: bool, residual: bool) -> bool:
    """Whether a GEMV of m rows runs the kernel's FLAT variant (FLAT above)."""
    return m == 1 and (FLAT == "1" or (FLAT == "auto" and (norm or silu or residual)))


@triton.jit
def _weight_tile(w_ptr, cols, col_ok, stride_wn, k0, K, BLOCK_K: tl.constexpr, VEC: tl.constexpr = 0):
    """w[cols, k0:k0 + BLOCK_K]. VEC > 0: the offsets say only VEC consecutive elements are contiguous, so Triton
    loads VEC at a time: an e4m3 tile read 8 at a time is laid out as a bf16 x tile is (8 a thread, 16 bytes), and
    the products need no re-layout of x through shared memory (read 16 at a time, 4 shared-memory stores a tile)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if VEC > 0:
        j = tl.arange(0, BLOCK_K)
        ks = k0 + (j // VEC) * VEC + j % VEC
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                   mask=col_ok[:, None] & (ks < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _input_tile(x_ptr, norm_ptr, rows, row_ok, stride_xm, k0, K, rstd,
                BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr):
    """in(x)[:, k0:k0 + BLOCK_K] in float32, rounded where the separate kernels round."""
    dt = x_ptr.dtype.element_ty
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x_mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
    if NORM:
        g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = ((x * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt).to(tl.float32)
    if SILU:  # x was the gate; the up half sits K further on
        up = tl.load(x_ptr + rows[:, None] * stride_xm + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        x = ((x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
    return x


@triton.jit
def _products(x, w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """x [1, BLOCK_K] * w [BLOCK_N, BLOCK_K] in float32, summed GROUP at a time along K where GROUP > 0."""
    p = x * w.to(tl.float32)
    if GROUP > 0:
        p = tl.sum(tl.reshape(p, [BLOCK_N, BLOCK_K // GROUP, GROUP]), 2)
    return p


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, w_scale_ptr, x_scale_ptr, M, N, K, stride_xm, stride_wn,
                 stride_om, stride_rm, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                 SPLIT_K: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, SILU: tl.constexpr,
                 RESIDUAL: tl.constexpr, PDL: tl.constexpr, FLAT: tl.constexpr = False,
                 W_SCALED: tl.constexpr = False, X_SCALED: tl.constexpr = False, W_VEC: tl.constexpr = 0,
                 GROUP: tl.constexpr = 0):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K). out[m, n] = sum_k in(x)[m, k] * w[n, k] (+ res[m, n]) for m < M <= ROWS,
    in(x) = x, RMSNorm(x) * norm (NORM) or silu(x[:, :K]) * x[:, K:] (SILU). PDL: launched as a programmatic
    dependent of the kernel before it, the program loads its first weight tile (which no kernel writes) before
    waiting for that kernel's output. FLAT (ROWS == 1): the weight tile stays in the layout it was loaded in (the
    [ROWS, BLOCK_N, BLOCK_K] product has Triton pass every weight tile through shared memory, with barriers, to
    reduce it; kernel_asm --one-row shows it). W_SCALED: w is e4m3, the sums times w_scale[n]; X_SCALED: x is
    e4m3 too, the sums times x_scale[m]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    if PDL:
        gdc_launch_dependents()  # the next kernel may start its own weight loads once every program is running
    w = _weight_tile(w_ptr, cols, col_ok, stride_wn, k_start, K, BLOCK_K, W_VEC)
    if PDL:
        gdc_wait()  # x and the residual are the previous kernel's output
    rstd = tl.zeros((ROWS,), dtype=tl.float32)
    if NORM:  # the row's 1 / rms in one reduction over all of K first, as kernels/rmsnorm.py takes it
        whole = tl.arange(0, NORM_BLOCK)
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + whole[None, :], mask=row_ok[:, None] & (whole < K)[None, :],
                     other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, 1) / K + eps)
    # [ROWS, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K, the first tile peeled off the loop
    x = _input_tile(x_ptr, norm_ptr, rows, row_ok, stride_xm, k_start, K, rstd, BLOCK_K, NORM, SILU)
    if FLAT:  # one row: products summed lane by lane over K, reduced across lanes once at the end
        # A plain read loads each weight tile one step ahead of its use (without it ptxas issued the loop's loads one
        # after another, each waiting for the last). Through the norm or SiLU, and for e4m3 tiles there, loading
        # ahead was slower (more registers a program), so those load each tile where it is used.
        # GROUP > 0 (e4m3 weights, FP8_GROUP): each step's products summed GROUP at a time within the lane before
        # they join the running sums, which then hold [BLOCK_N, BLOCK_K / GROUP] float32 values, a GROUP-th of the
        # registers.
        AHEAD: tl.constexpr = not (NORM or SILU)
        k_end = tl.minimum(k_start + k_per_split, K)
        if AHEAD:
            w_next = _weight_tile(w_ptr, cols, col_ok, stride_wn, k_start + BLOCK_K, k_end, BLOCK_K, W_VEC)
        part = _products(x, w, BLOCK_N, BLOCK_K, GROUP)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            if AHEAD:
                w = w_next
                w_next = _weight_tile(w_ptr, cols, col_ok, stride_wn, k0 + BLOCK_K, k_end, BLOCK_K, W_VEC)
            else:
                w = _weight_tile(w_ptr, cols, col_ok, stride_wn, k0, K, BLOCK_K, W_VEC)
            x = _input_tile(x_ptr, norm_ptr, rows, row_ok, stride_xm, k0, K, rstd, BLOCK_K, NORM, SILU)
            part += _products(x, w, BLOCK_N, BLOCK_K, GROUP)
        acc = tl.sum(part, axis=1)[None, :]
    else:
        acc = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        for k0 in range(k_start + BLOCK_K, min(k_start + k_per_split, K), BLOCK_K):
            w = _weight_tile(w_ptr, cols, col_ok, stride_wn, k0, K, BLOCK_K, W_VEC)
            x = _input_tile(x_ptr, norm_ptr, rows, row_ok, stride_xm, k0, K, rstd, BLOCK_K, NORM, SILU)
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if W_SCALED:
        acc = acc * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if X_SCALED:
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if RESIDUAL:  # the matmul's output rounded, then the add rounded: the unfused order
            res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


GEMV_KERNEL = _gemv_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 512, warps: int = 4,
         split_k: int = 1, weight_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] with K contiguous -> [M, N] in x's dtype (out_dtype for an e4m3 x).
    An e4m3 weight comes with weight_scale ([N] or [1, N] float32), an e4m3 x with x_scale ([M] or [M, 1])."""
    return _launch(x, weight, x.shape[-1], block_n, block_k, warps, split_k, weight_scale=weight_scale,
                   x_scale=x_scale, out_dtype=out_dtype)


def gemv_fused(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
               silu: bool = False, residual: torch.Tensor | None = None, block_n: int = 8, block_k: int = 1024,
               warps: int = 4, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The one-pass GEMV with a layer's small kernels in it (the module docstring): norm = (weight [K], eps) reads
    x through RMSNorm; silu reads x [M, 2K] as silu(gate) * up; residual [M, N] is added to the output. An e4m3
    weight comes with its weight_scale."""
    if norm is not None and silu:
        raise ValueError("gemv_fused: norm and silu are two readings of x; pick one")
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"gemv_fused: norm weight {tuple(norm[0].shape)} for K = {k}")
    if residual is not None and (residual.shape != (x.shape[0], weight.shape[0]) or residual.stride(-1) != 1):
        raise ValueError(f"gemv_fused: residual {tuple(residual.shape)} for {x.shape[0]} x {weight.shape[0]} out")
    return _launch(x, weight, k, block_n, block_k, warps, 1, norm, silu, residual, weight_scale)


def _scales(scale: torch.Tensor | None, length: int, what: str) -> torch.Tensor | None:
    if scale is None:
        return None
    if scale.dtype != torch.float32 or scale.numel() != length:
        raise ValueError(f"gemv: {what} {tuple(scale.shape)} {scale.dtype} for {length} (float32 wanted)")
    return scale.reshape(length).contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, k: int, block_n: int, block_k: int, warps: int, split_k: int,
            norm: tuple[torch.Tensor, float] | None = None, silu: bool = False,
            residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
            x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m = x.shape[0]
    n = weight.shape[0]
    if x.dim() != 2 or m > MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} (stride {weight.stride()})")
    if (weight.dtype == FP8_DTYPE) != (weight_scale is not None) or (x.dtype == FP8_DTYPE) != (x_scale is not None):
        raise ValueError("gemv: an e4m3 operand comes with its scales, and only an e4m3 one")
    if x.dtype == FP8_DTYPE and (norm is not None or silu or out_dtype is None):
        raise ValueError("gemv: an e4m3 x is read as it is (no norm or SiLU) and needs out_dtype")
    w_scale, x_scales = _scales(weight_scale, n, "weight_scale"), _scales(x_scale, m, "x_scale")
    x = x.contiguous()
    if split_k == 1:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    pdl = split_k == 1 and pdl_supported(x)  # split-K: its output is zero-filled before
    _gemv_kernel[grid](x, weight, out, norm[0] if norm is not None else x, residual if residual is not None else x,
                       w_scale if w_scale is not None else x, x_scales if x_scales is not None else x,
                       m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                       residual.stride(0) if residual is not None else 0, norm[1] if norm is not None else 0.0,
                       BLOCK_N=block_n, BLOCK_K=block_k, ROWS=triton.next_power_of_2(m), SPLIT_K=split_k,
                       NORM=norm is not None, NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1,
                       SILU=silu, RESIDUAL=residual is not None, PDL=pdl,
                       FLAT=_flat(m, norm is not None, silu, residual is not None),
                       W_SCALED=w_scale is not None, X_SCALED=x_scales is not None,
                       W_VEC=FP8_VEC if weight.dtype == FP8_DTYPE and x.dtype != FP8_DTYPE else 0,
                       GROUP=FP8_GROUP if weight.dtype == FP8_DTYPE else 0,
                       num_warps=warps, launch_pdl=pdl)
    return out if split_k == 1 else out.to(out_dtype or x.dtype)
