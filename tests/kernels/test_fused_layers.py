"""The fused Triton kernels the layers use on CUDA (SiLU-and-mul, q/k-norm + RoPE) against their references, and
the wiring: a whole tiny Llama/Qwen3 forward with the fused path forced on equals the torch path (interpreter on
CPU, where the layers would otherwise never take it)."""

import pytest
import torch

from shardserve.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from shardserve.kernels.rmsnorm import rms_norm_ref
from shardserve.kernels.rope import apply_rope_, rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_reference_across_blocks(dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(3, 5, 2 * 1100, dtype=dtype, device=DEVICE) * 4  # 1100 > one 1024 block: a masked tail
    out = silu_and_mul(gate_up)
    assert out.shape == (3, 5, 1100)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **tol)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_with_qk_norm_equals_norm_then_rope_on_strided_views(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE) * 3
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # views into the qkv output, as the layer passes them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    wq, wk = torch.rand(dim, dtype=dtype, device=DEVICE) + 0.5, torch.rand(dim, dtype=dtype, device=DEVICE) + 0.5
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    positions = torch.tensor([0, 9, 3, 63, 17], device=DEVICE)
    q_ref, k_ref = rope_ref(positions, rms_norm_ref(q, wq, 1e-6), rms_norm_ref(k, wk, 1e-6), cos, sin)
    apply_rope_(positions, q, k, cos, sin, (wq, wk), 1e-6)
    tol = dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_forward_with_fused_kernels_equals_torch_path(arch, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from shardserve.kernels.torch_backend import TorchAttentionBackend
    from shardserve.worker.layers import _fused
    from shardserve.worker.loader import load_weights
    from shardserve.worker.models.registry import build_model
    from tests.hf_reference import make_tiny_model
    from tests.kernels._paged_batch import make_batch

    folder = make_tiny_model(tmp_path / arch, arch, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    config = AutoConfig.from_pretrained(folder)
    model = build_model(config, torch.float32, torch.device(DEVICE), TorchAttentionBackend())
    load_weights(model, folder)
    # a prefill of 6 tokens and a decode over a 9-token context, on a paged cache per layer
    _, _, _, k_cache, v_cache, meta = make_batch([6, 1], [6, 9], num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=4, dtype=torch.float32, device=DEVICE)
    input_ids = torch.tensor([5, 17, 3, 99, 250, 7, 42], device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 8], device=DEVICE)

    def forward(fused: bool) -> torch.Tensor:
        monkeypatch.setattr(_fused, "use_fused", lambda x: fused)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(config.num_hidden_layers)]
        with torch.inference_mode():
            return model.compute_logits(model(input_ids, positions, caches, meta))

    plain, fused = forward(False), forward(True)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert plain.abs().max() > 0
