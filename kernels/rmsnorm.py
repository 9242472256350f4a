"""Triton RMSNorm, with the residual add fused in (as HF Llama/Qwen: normalise in float32, scale in the model dtype).

rms_norm(x, w) = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype); add_rms_norm also returns s = x + residual
(rounded to the model dtype, as the unfused model computes it) and normalises s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.fp8_linear import INV_FP8_MAX, MIN_AMAX, Fp8Rows, row_scale
from shardserve.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX
from shardserve.kernels.store_kv import to_e4m3
from shardserve.kernels.pdl import chained, start_as_dependent


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps, scale_ptr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False, FP8_OUT: tl.constexpr = False,
    FP8_LIMIT: tl.constexpr = None, INV_LIMIT: tl.constexpr = None, MIN_AMAX: tl.constexpr = None,
):
    """Grid (rows,). Program r normalises row r (adding its residual first when HAS_RESIDUAL). Every load comes
    before the residual's store (a load after a store that may alias it waits for it). PDL: launched as a
    programmatic dependent (kernels/pdl.py). FP8_OUT: the output row (rounded to x's dtype, as without it) is
    quantized to e4m3 over its own scale, stored at scale_ptr[r] (kernels/fp8_linear.py: quantize_rows' numbers)."""
    if PDL:
        start_as_dependent()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    if FP8_OUT:
        y = (normed * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), INV_LIMIT, MIN_AMAX)
        tl.store(scale_ptr + row, scale)
        q = to_e4m3(y, scale, FP8_LIMIT)
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            fp8_out: bool = False):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    if fp8_out and weight.dtype != x.dtype:
        raise ValueError(f"rms_norm with an FP8 output needs the weight in x's dtype ({x.dtype}), got {weight.dtype}")
    rows = x.reshape(-1, hidden)  # a view when x is contiguous in its last dim's rows (the usual case)
    out_dtype = FP8_DTYPE if fp8_out else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device) if fp8_out else out
    res_rows = residual.reshape(-1, hidden) if residual is not None else rows
    res_out = torch.empty_like(rows) if residual is not None else rows
    if rows.shape[0]:
        pdl = chained(x)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, res_out,
            rows.stride(0), res_rows.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps, scale,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden), PDL=pdl,
            FP8_OUT=fp8_out, FP8_LIMIT=FP8_MAX, INV_LIMIT=INV_FP8_MAX, MIN_AMAX=MIN_AMAX, launch_pdl=pdl,
        )
    if fp8_out:
        return Fp8Rows(out, scale, x.dtype), res_out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
    """RMSNorm over the last dim of x [..., hidden]; works for per-head norms ([T, heads, head_dim]) too. fp8_out:
    the rows quantized for an FP8 linear layer (Fp8Rows [rows, hidden]), as quantize_rows would."""
    return _launch(x, None, weight, eps, fp8_out)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the new hidden state and the new residual, in one pass."""
    return _launch(x, residual, weight, eps, fp8_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference, written as HF's LlamaRMSNorm (plus the unfused residual add)."""
    summed = x if residual is None else x + residual
    xf = summed.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, summed)
