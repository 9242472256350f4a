"""Triton split-K GEMM for decode batches: y = x W^T for x of a few to a few hundred rows, the weight streamed by many
programs at once.

At batch 32-256 cuBLAS reads Qwen3-0.6B's o_proj (1,024 x 2,048) and down (1,024 x 3,072) at 15-19% of an H200's
copy rate (6-8 us for 4-6 MB; docs/performance.md): with 1,024 output columns there are few output tiles, and each
walks all of K. Here the grid is (column tiles, row tiles, SPLIT_K): each program multiplies one K slice, writes its
float32 partial tile to a workspace and counts itself in the tile's counter; the last of a tile's SPLIT_K programs
to arrive sums the partials in a fixed order (the result does not depend on which program came last), writes the
output and puts the counter back to zero for the next launch. No memset and no second kernel, so it can sit in a
CUDA graph and in the PDL chain.

The counters are one array per device, shared by every launch: launches on one stream never overlap in their
counters (a programmatic dependent waits for the kernel before it at its very start), and the engine runs its
steps on one stream. SHARDSERVE_SPLITK_GEMM=N routes matmuls of 2..N rows to it (worker/layers/linear.py; 0, the
default, is off until timed).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from shardserve.kernels.pdl import supported as pdl_supported

COUNTERS = 16384  # output tiles one launch may have (a [256, 6144] output in 64 x 32 tiles is 768)
_counters: dict[torch.device, torch.Tensor] = {}

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages); SHARDSERVE_SPLITK_CONFIG="64,32,128,4,4,3" sets one for every
# shape (A/B runs of bench/gemm_rates.py's settings).
_FORCED = os.environ.get("SHARDSERVE_SPLITK_CONFIG", "")
FORCED_CONFIG = tuple(int(v) for v in _FORCED.split(",")) if _FORCED else None
if FORCED_CONFIG is not None and len(FORCED_CONFIG) != 6:
    raise ValueError(f"SHARDSERVE_SPLITK_CONFIG={_FORCED!r}: BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,warps,stages")


def choose_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """Launch settings for an [m, k] x [n, k]^T product: enough programs to stream the weight (untimed guesses
    until bench/gemm_rates.py has run on a GPU)."""
    if FORCED_CONFIG is not None:
        return FORCED_CONFIG
    block_m = 64 if m <= 64 else 128
    block_n = 32 if n <= 2048 else 64
    split_k = max(1, min(8, k // 512))
    return block_m, block_n, 128, split_k, 4, 3


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   PDL: tl.constexpr, IEEE: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): program (n, m, s) multiplies K slice s of output tile
    (m, n). IEEE: float32 products in full precision (tests; not TF32)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    if PDL:
        gdc_launch_dependents()  # the next kernel may launch once every program is running
        gdc_wait()  # x (and the counters' last reset) are the previous kernels' doing
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        inside = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ws = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile_ws + pid_k * (BLOCK_M * BLOCK_N) + inside, acc)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")  # releases the partial, acquires the others'
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: sum every partial in split order
            total = tl.load(tile_ws + inside, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                total += tl.load(tile_ws + s * (BLOCK_M * BLOCK_N) + inside, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


SPLITK_KERNEL = _splitk_kernel  # the jitted kernel itself, which bench/kernel_asm.py compiles for a GPU target


def _counter_array(device: torch.device) -> torch.Tensor:
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def splitk_gemm(x: torch.Tensor, weight: torch.Tensor,
                config: tuple[int, int, int, int, int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M, K] times weight [N, K]^T -> [M, N] in x's dtype. config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps,
    stages), default choose_config's."""
    m, k = x.shape[0], x.shape[-1]
    n = weight.shape[0]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"splitk_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"(stride {weight.stride()})")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, split_k, warps, stages = config or choose_config(m, n, k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    tiles = grid[0] * grid[1]
    if split_k > 1 and tiles > COUNTERS:
        raise ValueError(f"splitk_gemm: {tiles} output tiles, more than the {COUNTERS} counters")
    ws = torch.empty(tiles * split_k * block_m * block_n if split_k > 1 else 1, dtype=torch.float32, device=x.device)
    use_pdl = pdl and pdl_supported(x)
    _splitk_kernel[grid](x, weight, out, ws, _counter_array(x.device), m, n, k, x.stride(0), weight.stride(0),
                         out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                         PDL=use_pdl, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
                         launch_pdl=use_pdl)
    return out
