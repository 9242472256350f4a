"""Triton GEMM for decode batches (M of a few to a few hundred rows) with the layer's small kernels inside it.

A decode step at batch 128-256 reads each projection's weight once: Qwen3-0.6B's are 4-12 MB, a few microseconds at
the copy rate, and the layer around them is a chain of short kernels (add + RMSNorm, the GEMM, SiLU-and-mul, ...),
each paying its own launch and tail. This kernel is the matmul with those folded in, as kernels/gemv.py does for one
row:
- norm: x is the residual stream and the GEMM computes RMSNorm(x) * weight times W^T, as (x * weight) W^T scaled
  by each row's 1 / rms, whose squares it sums from the x tiles it loads anyway (no pass of its own),
- silu_mul: W is the merged gate_up projection; each program computes the gate and the up products of the same
  columns and writes silu(gate) * up (each output computed once, where a SiLU read by the down projection would
  recompute it in every program of a row block: timed 7x slower on an H200),
- residual: the output is x W^T + residual, the new residual stream.
The products go through tl.dot (tensor cores) accumulating in float32, in a different order from cuBLAS, and the
norm is applied around them rather than rounded before them: the unfused layer's values (kernels/rmsnorm.py,
activation.py) within the rounding of a bf16 matmul, not bit for bit.

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
def _gemm_rows_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_rm,
                      eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                      IEEE: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). out[m, n] = sum_k in(x)[m, k] * w[n, k] (+ res[m, n]);
    NORM: in(x) = RMSNorm(x) * norm, as x * norm into the products and 1 / rms per row (its squares summed from
    the same tiles) into the result; SILU_MUL: w holds 2N rows, and out = silu(gate) * up of the gate (rows < N)
    and up (rows >= N) products of the same columns. IEEE: float32 products in full precision (tests; not TF32)."""
    dt = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    w_up_rows = w_rows + N * stride_wn
    if PDL:
        gdc_launch_dependents()  # the next kernel may launch once every program is running
        gdc_wait()  # x and the residual are the previous kernel's output
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, 1)
            x = (xf * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            w_up = tl.load(w_up_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            if IEEE:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if NORM:
        rstd = 1.0 / tl.sqrt(squares / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if SILU_MUL:  # the projection's outputs rounded, then SiLU-and-mul as kernels/activation.py rounds it
        gate = acc.to(dt).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:  # the matmul's output rounded, then the add rounded: the unfused order
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        acc = acc.to(dt).to(tl.float32) + res.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


GEMM_ROWS_KERNEL = _gemm_rows_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
              silu_mul: bool = False, residual: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M, K] times weight [N, K]^T -> [M, N] in x's dtype, with the module docstring's fused reads; silu_mul:
    weight [2N, K] is the merged gate_up projection and the result is silu(gate) * up [M, N].
    config = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), default choose_config's."""
    m, k = x.shape[0], x.shape[-1]
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if x.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1 or (silu_mul and weight.shape[0] % 2):
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
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm is not None,
                            SILU_MUL=silu_mul, RESIDUAL=residual is not None, PDL=use_pdl,
                            IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return out


def gemm_rows_ref(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                  silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused layer's torch ops: what gemm_rows computes, within a matmul's rounding."""
    from shardserve.kernels.rmsnorm import rms_norm_ref

    y = (rms_norm_ref(x, norm[0], norm[1]) if norm is not None else x) @ weight.T
    if silu_mul:
        gate, up = y.float().chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate).to(y.dtype).float() * up).to(y.dtype)
    return y if residual is None else (y.float() + residual.float()).to(y.dtype)
