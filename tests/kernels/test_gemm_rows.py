"""The GEMM for decode batches (kernels/gemm_rows.py) against the separate kernels it replaces, in Triton's
interpreter on CPU (compiled in the GPU suite's run of this file): row and column counts that do not divide the
blocks, K over several steps with a masked tail, each fused reading (the norm, SiLU-and-mul of the gate_up projection, the residual)."""

import pytest
import torch

from shardserve.kernels.activation import silu_and_mul
from shardserve.kernels.gemm_rows import choose_config, gemm_rows, gemm_rows_ref
from shardserve.kernels.rmsnorm import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = (16, 16, 32, 4, 1)  # blocks smaller than the shapes: several programs each way and K steps


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def _inputs(m, n, k, dtype, seed, x_width=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, x_width or k, generator=gen) * 2).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    return gen, x, w


@pytest.mark.parametrize("m, n, k", [(3, 40, 96), (37, 33, 200)])
def test_plain_product_equals_matmul(m, n, k):
    _, x, w = _inputs(m, n, k, torch.float32, m)
    torch.testing.assert_close(gemm_rows(x, w, config=SMALL), x @ w.T, **_tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_reading_is_rms_norm_then_matmul(dtype):
    gen, h, w = _inputs(19, 40, 200, dtype, 5)  # K = 200: the squares summed over 7 masked steps
    g = (torch.rand(200, generator=gen) + 0.5).to(dtype=dtype, device=DEVICE)
    fused = gemm_rows(h, w, norm=(g, 1e-6), config=SMALL)
    torch.testing.assert_close(fused, rms_norm(h, g, 1e-6) @ w.T, **_tol(dtype))
    torch.testing.assert_close(fused, gemm_rows_ref(h, w, norm=(g, 1e-6)), **_tol(dtype))
    assert not torch.allclose(fused.float(), (h @ w.T).float(), atol=0.1)  # it did normalise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
def test_silu_mul_reading_is_the_gate_up_projection_then_silu_and_mul(dtype, norm):
    gen, h, w = _inputs(21, 66, 150, dtype, 7)  # w: gate rows 0..32, up rows 33..65
    g = ((torch.rand(150, generator=gen) + 0.5).to(dtype=dtype, device=DEVICE), 1e-6) if norm else None
    fused = gemm_rows(h, w, norm=g, silu_mul=True, config=SMALL)
    assert fused.shape == (21, 33)
    plain = silu_and_mul((rms_norm(h, *g) if norm else h) @ w.T)
    torch.testing.assert_close(fused, plain, **_tol(dtype))
    torch.testing.assert_close(fused, gemm_rows_ref(h, w, norm=g, silu_mul=True), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_reading_adds_the_residual_after_rounding_the_product(dtype):
    gen, x, w = _inputs(21, 33, 150, dtype, 8)
    residual = torch.randn(21, 33, generator=gen).to(dtype=dtype, device=DEVICE)
    fused = gemm_rows(x, w, residual=residual, config=SMALL)
    torch.testing.assert_close(fused, ((x @ w.T).float() + residual.float()).to(dtype), **_tol(dtype))


def test_default_launch_settings_cover_a_batch_larger_than_one_block():
    _, x, w = _inputs(70, 24, 64, torch.float32, 9)
    assert choose_config(70, 24, 64)[0] < 70  # two row blocks
    torch.testing.assert_close(gemm_rows(x, w), x @ w.T, **_tol(torch.float32))


def test_refuses_mismatched_inputs():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        gemm_rows(x, torch.zeros(5, 8, device=DEVICE), silu_mul=True)  # gate and up: an even number of rows
    with pytest.raises(ValueError, match="norm weight"):
        gemm_rows(x, torch.zeros(4, 8, device=DEVICE), norm=(torch.ones(5, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        gemm_rows(x, torch.zeros(4, 8, device=DEVICE), residual=torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        gemm_rows(x, torch.zeros(4, 9, device=DEVICE))
