"""FP8 weights (kernels/fp8_linear.py): the per-token quantization kernel against its torch reference, byte for
byte, and the quantized product against float32. In the interpreter on CPU; compiled, with the FP8 GEMM, in the GPU
suite (tests/gpu/test_fp8_gpu.py)."""

import pytest
import torch

from shardserve.kernels.fp8_linear import (fp8_linear, quantize_rows, quantize_rows_ref,
                                           quantize_weight)
from shardserve.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX
from shardserve.worker.layers.linear import ColumnParallelLinear, RowParallelLinear, quantize_linear_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 576, 3000, 20000])  # short, the default model's hidden size, a tail, two passes
def test_quantize_rows_matches_the_torch_reference_byte_for_byte(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0])[:, None]).to(dtype)
    x[4] = 0.0  # a row of zeros
    x[1, 7] = -5.0  # a row whose largest magnitude is negative
    x[2, 5] = -1e-9  # rounds to zero: -0 (0x80), as torch converts it
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_ref(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # each row's largest magnitude lands on +-448, and the zero row stays zero with a finite scale
    assert torch.equal(q[:4].float().abs().amax(-1), torch.full((4,), FP8_MAX))
    assert q[1, 7].float() == -FP8_MAX and q[4].float().abs().max() == 0 and scale[4] > 0
    assert q.view(torch.uint8)[2, 5] == 0x80


def test_quantized_product_is_within_the_formats_error_and_scales_per_channel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    w = torch.randn(96, 256, generator=g) * torch.logspace(-3, 1, 96)[:, None]  # channels 4 decades apart
    wq, w_scale = quantize_weight(w)
    assert wq.dtype == FP8_DTYPE and w_scale.shape == (1, 96)
    exact = x @ w.t()
    got = fp8_linear(x, wq, w_scale)
    # e4m3 keeps 3 mantissa bits (~4% rms error over a product of two quantized operands): every output channel
    # within 8% rms of its exact value (64 rows), however small its weights' scale; a scale for the whole tensor
    # would flush the smallest channels (1e-4 of the largest's weights) to e4m3's zero
    err = ((got - exact).norm(dim=0) / exact.norm(dim=0))
    assert err.max() < 0.08, err.max()
    assert ((got - exact).norm() / exact.norm()) < 0.05
    # against a product written here from the format alone (per-token scales amax / 448, e4m3 values, float64):
    # within 1e-3 of its norm, where the format's own error is ~4%
    x_scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    xq = (x / x_scale).to(FP8_DTYPE)
    independent = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double().t()).t()
    assert ((got.double() - independent).norm() / independent.norm()) < 1e-3
    # the bias is added after the scaled product; leading dims are kept
    bias = torch.randn(96, generator=g)
    assert torch.equal(fp8_linear(x.view(8, 8, 256), wq, w_scale, bias), (got + bias).view(8, 8, 96))


def test_quantize_linear_weights_turns_the_projections_fp8_and_keeps_their_outputs():
    torch.manual_seed(0)
    column, row = ColumnParallelLinear(128, 64), RowParallelLinear(64, 32)
    for layer in (column, row):
        layer.weight.data.normal_(0, 0.02)
    model = torch.nn.Sequential(column, row)
    x = torch.randn(4, 128)
    exact = model(x)
    assert quantize_linear_weights(model) == 2
    assert column.weight.dtype == FP8_DTYPE and column.weight_scale.shape == (1, 64)
    assert row.weight.dtype == FP8_DTYPE and row.weight_scale.shape == (1, 32)
    got = model(x)
    assert ((got - exact).norm() / exact.norm()) < 0.08  # two quantized products in a row (~6% rms measured)
    assert not torch.equal(got, exact)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_with_fp8_out_hands_over_the_rows_quantize_rows_would_make(residual):
    from shardserve.kernels.rmsnorm import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 576, generator=g) * 3).to(torch.bfloat16)
    r = torch.randn(6, 576, generator=g).to(torch.bfloat16)
    w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    if residual:
        (rows, summed), (plain, summed_plain) = add_rms_norm(x, r, w, 1e-6, fp8_out=True), add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(summed, summed_plain)
    else:
        rows, plain = rms_norm(x, w, 1e-6, fp8_out=True), rms_norm(x, w, 1e-6)
    q_ref, scale_ref = quantize_rows_ref(plain)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows.scale, scale_ref)
    assert torch.equal(rows.q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_linear_takes_quantized_rows_as_the_plain_input_would_be_quantized():
    from shardserve.kernels.fp8_linear import Fp8Rows

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    wq, w_scale = quantize_weight(torch.randn(32, 64, generator=g) * 0.1)
    assert torch.equal(fp8_linear(Fp8Rows(*quantize_rows_ref(x), torch.bfloat16), wq, w_scale),
                       fp8_linear(x, wq, w_scale))


def test_widen_gives_every_e4m3_byte_torchs_value():
    """kernels/kv_fp8.py: widen (the CPU's table) against torch's conversion, all 256 bytes (NaN for NaN), in
    the shape given."""
    from shardserve.kernels.kv_fp8 import widen

    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(16, 16)
    got, want = widen(codes), codes.float()
    assert got.shape == (16, 16) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))  # -0 too
    assert torch.equal(widen(codes, torch.bfloat16).nan_to_num(), codes.to(torch.bfloat16).nan_to_num())
    strided = codes.t()[::2]  # not contiguous: the values in the view's order
    assert torch.equal(widen(strided).nan_to_num(), strided.float().nan_to_num())
