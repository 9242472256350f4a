"""Triton GEMM for decode batches (M of a few to a few hundred rows) with the layer's small kernels inside it.

A decode step at batch 128-256 reads each projection's weight once: Qwen3-0.6B's are 4-12 MB, a few microseconds at
the copy rate, and the layer around them is a chain of short kernels (add + RMSNorm, the GEMM, SiLU-and-mul, ...),
each paying its own launch and tail. This kernel is the matmul with those folded in, as kernels/gemv.py does for one
row:
- norm: x is the residual stream and the GEMM reads RMSNorm(x) * weight (each program sums its rows' squares over K
  first: M x K x 2 bytes, a few hundred KB from L2 against the MBs of weight it streams),
- silu: x is the merged gate_up output [M, 2K] and the GEMM reads silu(gate) * up,
- residual: the output is x W^T + residual, the new residual stream.
Each is rounded where the separate kernels round (kernels/rmsnorm.py, activation.py). The products go through
tl.dot (tensor cores) accumulating in float32, in a different order from cuBLAS: the same values within the
rounding of a bf16 matmul, not bit for bit.

On Hopper it launches as a programmatic dependent of the kernel before it (kernels/pdl.py): its launch and its
programs' start overlap that kernel's tail; every program waits for it before any load.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from shardserve.kernels.pdl import supported as pdl_supported

# Launch settings (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); SHARDSERVE_GEMM_ROWS_CONFIG="64,64,128,4,3" sets one
# for every shape (A/B runs of bench/gemm_rates.py's settings).
_FORCED = os.environ.get("SHARDSERVE_GEMM_ROWS_CONFIG", "")
FORCED_CONFIG = tuple(int(v) for v in _FORCED.split(",")) if _FORCED else None
if FORCED_CONFIG is not None and len(FORCED_CONFIG) != 5:
    raise ValueError(f"SHARDSERVE_GEMM_ROWS_CONFIG={_FORCED!r}: BLOCK_M,BLOCK_N,BLOCK_K,warps,stages")


def choose_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """Launch settings for an [m, k] x [n, k]^T product."""
    if FORCED_CONFIG is not None:
        return FORCED_CONFIG
    return (64, 64, 128, 4, 3)


@triton.jit
def _rows_in(x_ptr, norm_ptr, rows, row_ok, stride_xm, k0, K, rstd,
             BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr):
    """in(x)[rows, k0:k0 + BLOCK_K] in x's dtype, rounded where the separate kernels round."""
    dt = x_ptr.dtype.element_ty
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if NORM:
        g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
    if SILU:  # x was the gate; the up half sits K further on
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + rows[:, None] * stride_xm + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        x = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
    return x


@triton.jit
def _gemm_rows_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_rm,
                      eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                      IEEE: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); the column tiles of one row tile are neighbours, so programs
    reading the same weight columns for other rows find them in L2. out[m, n] = sum_k in(x)[m, k] * w[n, k]
    (+ res[m, n]), in(x) as in _rows_in. IEEE: float32 products in full precision (tests; not TF32)."""
    dt = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    if PDL:
        gdc_launch_dependents()  # the next kernel may launch once every program is running
        gdc_wait()  # x and the residual are the previous kernel's output
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:  # the rows' 1 / rms over all of K first
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :],
                         other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, 1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = _rows_in(x_ptr, norm_ptr, rows, row_ok, stride_xm, k0, K, rstd, BLOCK_K, NORM, SILU)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:  # the matmul's output rounded, then the add rounded: the unfused order
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        acc = acc.to(dt).to(tl.float32) + res.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


GEMM_ROWS_KERNEL = _gemm_rows_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
              silu: bool = False, residual: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu) times weight [N, K]^T -> [M, N] in x's dtype, with the module docstring's
    fused reads. config = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), default choose_config's."""
    if norm is not None and silu:
        raise ValueError("gemm_rows: norm and silu are two readings of x; pick one")
    m, n = x.shape[0], weight.shape[0]
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    if x.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemm_rows: x {tuple(x.shape)} and weight {tuple(weight.shape)} (stride {weight.stride()})")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"gemm_rows: norm weight {tuple(norm[0].shape)} for K = {k}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"gemm_rows: residual {tuple(residual.shape)} for {m} x {n} out")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = config or choose_config(m, n, k)
    use_pdl = pdl and pdl_supported(x)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gemm_rows_kernel[grid](x, weight, out, norm[0] if norm is not None else x, residual if residual is not None else x,
                            m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                            residual.stride(0) if residual is not None else 0, norm[1] if norm is not None else 0.0,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm is not None, SILU=silu,
                            RESIDUAL=residual is not None, PDL=use_pdl, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
                            launch_pdl=use_pdl)
    return out


def gemm_rows_ref(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                  silu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused layer's torch ops in the same roundings: the reference gemm_rows is tested against."""
    from shardserve.kernels.rmsnorm import rms_norm_ref

    if norm is not None:
        x = rms_norm_ref(x, norm[0], norm[1])
    if silu:
        gate, up = x.chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    y = x @ weight.T
    return y if residual is None else (y.float() + residual.float()).to(y.dtype)
