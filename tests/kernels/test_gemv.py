"""The Triton GEMV (kernels/gemv.py) against torch's matmul in float32, in Triton's interpreter on CPU (compiled in
the GPU suite's run of this file): batch 1-4, shapes that do not divide the blocks, split-K."""

from __future__ import annotations

import pytest
import torch

from shardserve.kernels.gemv import gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n, k, split_k", [(40, 96, 1), (33, 200, 2), (16, 64, 4)])
def test_gemv_equals_matmul(m, n, k, split_k):
    gen = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    out = gemv(x, w, block_n=16, block_k=32, split_k=split_k)
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_gemv_refuses_more_rows_than_it_holds():
    with pytest.raises(ValueError):
        gemv(torch.zeros(5, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))
