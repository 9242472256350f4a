"""The split-K GEMM for decode batches (kernels/gemm_splitk.py) against torch's matmul, in Triton's interpreter on
CPU (compiled in the GPU suite's run of this file): shapes that do not divide the blocks, K split over programs
whose partial tiles the last one sums, and the tile counters left at zero for the next launch."""

import pytest
import torch

from shardserve.kernels import gemm_splitk
from shardserve.kernels.gemm_splitk import choose_config, splitk_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(m, n, k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    return x, w


@pytest.mark.parametrize("m, n, k, split_k", [(3, 40, 96, 1), (37, 33, 200, 3), (20, 64, 512, 4)])
def test_split_k_product_equals_matmul(m, n, k, split_k):
    x, w = _inputs(m, n, k, seed=m)
    out = splitk_gemm(x, w, config=(16, 16, 32, split_k, 4, 1))
    torch.testing.assert_close(out, x @ w.T, atol=1e-5, rtol=1e-5)


def test_counters_are_back_at_zero_so_the_next_launch_sums_its_own_partials():
    x, w = _inputs(37, 33, 200, seed=5)
    config = (16, 16, 32, 3, 4, 1)
    first = splitk_gemm(x, w, config=config)
    assert int(gemm_splitk._counter_array(x.device).abs().sum()) == 0
    x2 = x.flip(0).contiguous()
    torch.testing.assert_close(splitk_gemm(x2, w, config=config), x2 @ w.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first, x @ w.T, atol=1e-5, rtol=1e-5)


def test_half_precision_within_a_matmul_rounding():
    x, w = _inputs(19, 48, 256, torch.float16, seed=9)
    out = splitk_gemm(x, w, config=(16, 16, 64, 2, 4, 1))
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=2e-2, rtol=1e-2)


def test_default_settings_split_a_long_k_and_cover_many_rows():
    assert choose_config(256, 1024, 3072)[3] > 1  # K = 3,072 split
    x, w = _inputs(70, 24, 1024, seed=3)
    torch.testing.assert_close(splitk_gemm(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="weight"):
        splitk_gemm(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 9, device=DEVICE))


def test_launches_back_to_back_each_sum_their_own_partials():
    """Many tiles, K split four ways, ten launches queued without a sync between them (on a GPU the programs of a
    tile race to be last, and each launch reuses the counters the one before put back): every output right."""
    m, n, k = (256, 1024, 2048) if DEVICE == "cuda" else (40, 48, 256)
    config = (64, 32, 128, 4, 4, 3) if DEVICE == "cuda" else (16, 16, 32, 4, 4, 1)
    xs = [_inputs(m, n, k, seed=s)[0] for s in range(10)]
    _, w = _inputs(m, n, k, seed=99)
    outs = [splitk_gemm(x, w, config=config) for x in xs]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, x @ w.T, atol=1e-3, rtol=1e-4)
