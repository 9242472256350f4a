"""Triton SiLU-and-mul: silu(gate) * up over the merged gate_up projection, in one pass.

As the unfused layer computes it (worker/layers/activation.py): silu in float32 rounded to the model dtype, then
the product in float32 rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, then up) -> [..., d]."""
    two_d = gate_up.shape[-1]
    if two_d % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {two_d}")
    d = two_d // 2
    rows = gate_up.reshape(-1, two_d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        pdl = chained(rows)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, _BLOCK))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=_BLOCK, PDL=pdl, launch_pdl=pdl,
        )
    return out.view(*gate_up.shape[:-1], d)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
