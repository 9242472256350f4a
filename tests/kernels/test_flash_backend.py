"""The flash-attn backend against the torch backend, where flash-attn is installed (never on our machines)."""

import pytest
import torch

pytest.importorskip("flash_attn", reason="flash-attn is not installed (no wheel; it cannot be installed here)")
if not torch.cuda.is_available():
    pytest.skip("flash-attn needs a CUDA GPU", allow_module_level=True)

from _paged_batch import make_batch  # noqa: E402

from shardserve.kernels.flash import FlashAttentionBackend  # noqa: E402
from shardserve.kernels.torch_backend import TorchAttentionBackend  # noqa: E402


def test_flash_backend_matches_torch_backend_on_mixed_batch():
    q, k, v, k_cache, v_cache, meta = make_batch(
        [1, 37, 5], [300, 37, 600], num_heads=8, num_kv_heads=2, head_dim=128, block_size=256,
        dtype=torch.bfloat16, device="cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, k_ref, v_ref, meta, 0.088)
    out = FlashAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.088)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
