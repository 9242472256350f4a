"""FP8 weights for the decoder's linear layers (`quantization="fp8"`): W8A8 with per-channel and per-token scales.

At start-up each projection's weight W [N, K] becomes float8 e4m3 with one float32 scale per output channel
(row n: its largest magnitude maps to 448), computed from the loaded weight (no calibration data). At each call
the activations x [M, K] are quantized the same way per token (row m, one pass of `quantize_rows`), and the
product runs on FP8 tensor cores with both scales applied to the float32 accumulator:
y[m, n] = (sum_k xq[m, k] wq[n, k]) * sx[m] * sw[n]. That halves the weights' bytes and runs the products at twice
bf16's rate, so large matrices gain at every batch size; small matrices at small M gain nothing or lose
(docs/performance.md).

The LM head and the embedding keep the model's dtype. Without CUDA (or where a dimension is not a multiple of 16,
which the FP8 GEMM needs) `fp8_linear` computes the same quantized product in float32 in torch: the CPU runs the
same numbers slower, so the format's effect on a model's outputs can be measured where no GPU holds the model.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardserve.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8, widen
from shardserve.kernels.store_kv import to_e4m3

MIN_AMAX = 1e-12  # a row of zeros gets this largest magnitude (its scale stays finite and non-zero)
# A scale is amax times the float32 nearest 1/448, not amax / 448: torch divides a CUDA tensor by a Python number
# that way (and a CPU tensor exactly), so the product is the one form every device and the kernels compute alike.
INV_FP8_MAX = 1.0 / FP8_MAX


class Fp8Rows(NamedTuple):
    """Activations already quantized per token, as quantize_rows makes them, by the kernel that computed them
    (kernels/rmsnorm.py with fp8_out): what an FP8 linear layer takes as it is."""
    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the model's dtype: the product's output


@triton.jit
def row_scale(amax, INV_LIMIT: tl.constexpr, MIN: tl.constexpr):
    """A row's scale from its largest magnitude, as quantize_rows_ref takes it: max(amax, MIN) * INV_FP8_MAX."""
    return tl.maximum(amax, MIN) * INV_LIMIT


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_o, FP8_LIMIT: tl.constexpr,
                          INV_LIMIT: tl.constexpr, MIN: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """Grid (M,). Program m: the row's largest magnitude, its scale (row_scale), then the row divided by it and
    rounded to e4m3. WHOLE_ROW (BLOCK >= K): the row is loaded once and held, as RMSNorm's FP8 output is made
    (kernels/rmsnorm.py); else two passes over BLOCK-wide pieces."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if WHOLE_ROW:
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), 0), INV_LIMIT, MIN)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(x, scale, FP8_LIMIT).to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, 0), INV_LIMIT, MIN)
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = to_e4m3(x, scale, FP8_LIMIT)
            tl.store(out_ptr + row * stride_o + start + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


# Rows up to this many elements are quantized from one load (Llama-3-8B's widest input, down's 14,336, among them),
# as RMSNorm's FP8 output is made; wider rows in two passes over pieces of 2,048.
WHOLE_ROW_MAX = 16384


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (e4m3 [M, K], float32 scales [M, 1]): each row over its own scale."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows needs a 2-D input with its last dim contiguous, got {tuple(x.shape)}")
    rows, k = x.shape
    out = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        whole = triton.next_power_of_2(k) <= WHOLE_ROW_MAX
        block = triton.next_power_of_2(k) if whole else 2048
        _quantize_rows_kernel[(rows,)](x, out, scale, k, x.stride(0), out.stride(0), FP8_LIMIT=FP8_MAX,
                                       INV_LIMIT=INV_FP8_MAX, MIN=MIN_AMAX, BLOCK=block, WHOLE_ROW=whole,
                                       num_warps=max(4, min(16, block // 1024)))
    return out, scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of quantize_rows (any float dtype; the scales over dim -1)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_(min=MIN_AMAX) * INV_FP8_MAX
    return quantize_fp8(x, scale.squeeze(-1)), scale  # (each row as the FP8 cache quantizes a head)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], float32 scales [1, N]): one scale per output channel (row of W)."""
    q, scale = quantize_rows_ref(weight)
    return q, scale.t().contiguous()


@functools.cache
def _fp8_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _tensor_cores(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this product: CUDA (compute capability >= 8.9) and K, N multiples of 16."""
    return x.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and _fp8_capable(x.device)


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (the model's dtype, or Fp8Rows [M, K]) @ W^T for W given as (e4m3 [N, K], scales [1, N]), + bias
    -> [..., N] in the model's dtype; a plain x is quantized per token first."""
    fast = _tensor_cores(x.q if isinstance(x, Fp8Rows) else x, weight)
    if isinstance(x, Fp8Rows):
        (xq, x_scale), dtype, lead = (x.q, x.scale), x.dtype, x.q.shape[:-1]
    else:
        rows, dtype, lead = x.reshape(-1, x.shape[-1]), x.dtype, x.shape[:-1]
        if fast:
            xq, x_scale = quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous())
        else:
            xq, x_scale = quantize_rows_ref(rows)
    if fast:
        # fast accumulation: the products' partial sums promoted to float32 every few steps rather than at each
        # one: faster at prefill sizes, and within the format's own error (tests/gpu)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=dtype,
                             use_fast_accum=True)
    else:
        y = _dequantized_product(xq, x_scale, weight, weight_scale).to(dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def _dequantized_product(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    return (widen(xq) * x_scale) @ (widen(weight) * weight_scale.t()).t()


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The quantized product in float32 (the CPU path and the tests' reference): x [M, K] quantized per row by
    quantize_rows_ref, both operands widened exactly and scaled, one float32 matmul."""
    return _dequantized_product(*quantize_rows_ref(x), weight, weight_scale)
