"""The flash-attn backend against the torch backend, on a CUDA host where flash-attn is installed (it is optional:
no wheel on PyPI)."""

import pytest
import torch

from tests.kernels._paged_batch import make_batch

from shardserve.kernels.torch_backend import TorchAttentionBackend

# A GPU test (make test-gpu): CPU runs deselect it instead of reporting a skip on every host.
pytestmark = pytest.mark.gpu


def test_flash_backend_matches_torch_backend_on_mixed_batch():
    pytest.importorskip("flash_attn", reason="flash-attn is optional and not installed on this host")
    from shardserve.kernels.flash import FlashAttentionBackend

    q, k, v, k_cache, v_cache, meta = make_batch(
        [1, 37, 5], [300, 37, 600], num_heads=8, num_kv_heads=2, head_dim=128, block_size=256,
        dtype=torch.bfloat16, device="cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, k_ref, v_ref, meta, 0.088)
    out = FlashAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.088)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
