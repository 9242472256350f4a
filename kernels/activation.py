"""Triton SiLU-and-mul: silu(gate) * up over the merged gate_up projection, in one pass.

As the unfused layer computes it (worker/layers/activation.py): silu in float32 rounded to the model dtype, then
the product in float32 rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.fp8_linear import MIN_AMAX, Fp8Rows, row_scale, to_e4m3
from shardserve.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX
from shardserve.kernels.pdl import chained, start_as_dependent

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, cdiv(d, BLOCK)). Row r's gate is x[r, :d], its up x[r, d:2d]. PDL: launched as a programmatic
    dependent (kernels/pdl.py)."""
    if PDL:
        start_as_dependent()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr,
                             FP8_LIMIT: tl.constexpr, MIN_AMAX: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows,). Row r's silu(gate) * up (rounded to x's dtype, as _silu_and_mul_kernel's), quantized to e4m3
    over the row's own scale (stored at scale_ptr[r]): two passes over the row, the second computing it again
    (its gate and up are then in the L2 cache) rather than keeping a copy."""
    if PDL:
        start_as_dependent()
    row = tl.program_id(0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_times_up(x_ptr + row * stride_x, cols, d, dt)
        amax = tl.maximum(amax, tl.abs(y))
    scale = row_scale(tl.max(amax, 0), FP8_LIMIT, MIN_AMAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_times_up(x_ptr + row * stride_x, cols, d, dt)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(y, scale, FP8_LIMIT).to(out_ptr.dtype.element_ty),
                 mask=cols < d)


@triton.jit
def _silu_times_up(row_ptr, cols, d, dt: tl.constexpr):
    """silu(gate) * up at cols of one row, rounded as _silu_and_mul_kernel rounds, in float32 (0 past d)."""
    mask = cols < d
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (act * up).to(dt).to(tl.float32)


def silu_and_mul(gate_up: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
    """[..., 2 * d] (gate, then up) -> [..., d]. fp8_out: the rows quantized for an FP8 linear layer (Fp8Rows
    [rows, d]), as quantize_rows would."""
    two_d = gate_up.shape[-1]
    if two_d % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {two_d}")
    d = two_d // 2
    rows = gate_up.reshape(-1, two_d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if fp8_out:
        out = torch.empty(rows.shape[0], d, dtype=FP8_DTYPE, device=gate_up.device)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=gate_up.device)
        if rows.shape[0]:
            pdl = chained(rows, elementwise=True)
            _silu_and_mul_fp8_kernel[(rows.shape[0],)](
                rows, out, scale, rows.stride(0), out.stride(0), d, BLOCK=min(_BLOCK, triton.next_power_of_2(d)),
                FP8_LIMIT=FP8_MAX, MIN_AMAX=MIN_AMAX, PDL=pdl, launch_pdl=pdl,
            )
        return Fp8Rows(out, scale, gate_up.dtype)
    out = torch.empty(rows.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        pdl = chained(rows, elementwise=True)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, _BLOCK))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=_BLOCK, PDL=pdl, launch_pdl=pdl,
        )
    return out.view(*gate_up.shape[:-1], d)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
