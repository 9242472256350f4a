"""Triton GEMV for decode at batch 1-4: y = x W^T with W [N, K] read once, at the copy rate.

At M = 1 the matmul is a pass over the weight. cuBLAS picks 64-wide tiles and split-K for Llama-3-8B's qkv
(6,144 x 4,096) and o_proj (4,096 x 4,096) and reads them at ~72% of the H200's copy rate (docs/performance.md,
bs=1 profile). Here each program owns BLOCK_N output columns and walks K in BLOCK_K steps, every row of x against
the same weight tile (loaded once, coalesced along K), accumulating in float32; SPLIT_K > 1 gives each program
1/SPLIT_K of K and adds its partial sums into a float32 buffer with atomics (for shapes with few columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K). out[m, n] = sum_k x[m, k] * w[n, k] for m < M <= ROWS."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    for k0 in range(k_start, min(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # [ROWS, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 512, warps: int = 4,
         split_k: int = 1) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] with K contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} (stride {weight.stride()})")
    x = x.contiguous()
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    _gemv_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_N=block_n,
                       BLOCK_K=block_k, ROWS=triton.next_power_of_2(m), SPLIT_K=split_k, num_warps=warps)
    return out if split_k == 1 else out.to(x.dtype)
