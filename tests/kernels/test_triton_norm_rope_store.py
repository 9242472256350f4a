"""Triton store_kv, RMSNorm (plain and fused residual) and RoPE against their torch references (interpreter on CPU)."""

import pytest
import torch

from shardserve.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_ref
from shardserve.kernels.rope import apply_rope_, rope_ref
from shardserve.kernels.store_kv import store_kv
from shardserve.kernels.torch_backend import store_kv as store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_each_token_at_its_slot_and_skips_minus_one(dtype):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 3, 24  # non-power-of-2 heads and dim exercise masks
    k = torch.randn(7, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(7, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 12], device=DEVICE)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # slot 23 is the last offset of the last block; the -1 tokens left no trace anywhere
    assert torch.equal(k_cache[5, 3], k[3])
    assert int((k_cache.flatten(0, 1).abs().sum((1, 2)) > 0).sum()) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_hf_formula(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 40, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(40, dtype=dtype, device=DEVICE)
    out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=2e-3, rtol=2e-3)


def test_rms_norm_per_head_on_3d_input():
    torch.manual_seed(1)
    x = torch.randn(3, 4, 16, device=DEVICE)  # Qwen3's q_norm/k_norm shape: [T, heads, head_dim]
    weight = torch.rand(16, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_returns_normed_sum_and_new_residual(dtype):
    torch.manual_seed(2)
    x = torch.randn(4, 64, dtype=dtype, device=DEVICE)
    residual = torch.randn(4, 64, dtype=dtype, device=DEVICE)
    weight = torch.randn(64, dtype=dtype, device=DEVICE)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    assert not torch.equal(out, rms_norm_ref(x, weight, 1e-6))  # the residual really entered the norm


def _cos_sin(max_pos: int, rot_dim: int, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_rotates_q_and_k_in_place_like_reference(dtype):
    torch.manual_seed(3)
    q = torch.randn(5, 6, 32, dtype=dtype, device=DEVICE)
    k = torch.randn(5, 2, 32, dtype=dtype, device=DEVICE)
    cos, sin = _cos_sin(64, 32)
    positions = torch.tensor([0, 7, 3, 63, 20], device=DEVICE)
    q_ref, k_ref = rope_ref(positions, q, k, cos, sin)
    q_out, k_out = apply_rope_(positions, q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr()
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else {}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)


def test_rope_position_zero_is_identity_and_partial_rotary_keeps_tail():
    torch.manual_seed(4)
    q = torch.randn(2, 3, 16, device=DEVICE)
    k = torch.randn(2, 1, 16, device=DEVICE)
    q0, k0 = q.clone(), k.clone()
    cos, sin = _cos_sin(8, 8)  # rot_dim 8 of head_dim 16
    apply_rope_(torch.tensor([0, 5], device=DEVICE), q, k, cos, sin)
    torch.testing.assert_close(q[0], q0[0])  # angle 0
    assert torch.equal(q[1, :, 8:], q0[1, :, 8:]) and torch.equal(k[1, :, 8:], k0[1, :, 8:])
    assert not torch.allclose(q[1, :, :8], q0[1, :, :8])


def test_rope_matches_the_model_layers_rotary_embedding():
    rotary = pytest.importorskip("shardserve.worker.layers.rotary")
    torch.manual_seed(5)
    emb = rotary.RotaryEmbedding(32, 128, 10000.0).to(DEVICE)
    q = torch.randn(4, 4, 32, device=DEVICE)
    k = torch.randn(4, 2, 32, device=DEVICE)
    positions = torch.tensor([1, 50, 2, 127], device=DEVICE)
    q_ref, k_ref = emb(positions, q, k)
    apply_rope_(positions, q, k, emb.cos_cache, emb.sin_cache)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)


def test_decode_slots_kernel_gives_the_reference_slots_and_int32_lengths():
    """kernels/store_kv.decode_slots (a decode graph's one launch for its slots) against step_inputs.slot_mapping:
    row i's table is row i, a row with context 0 (padding) gets slot -1, and the lengths come back as int32."""
    from shardserve.kernels.store_kv import decode_slots
    from shardserve.worker.step_inputs import slot_mapping

    gen = torch.Generator().manual_seed(5)
    n, width, bs = 300, 9, 16
    tables = torch.randint(0, 1000, (n + 4, width), generator=gen, dtype=torch.int32)  # rows past n: stale
    lengths = torch.randint(0, width * bs, (n,), generator=gen, dtype=torch.int64)
    lengths[::7] = 0  # padding rows: position 0, context 0
    positions = torch.where(lengths > 0, lengths - 1, 0)
    slots, lengths32 = decode_slots(positions, lengths, tables, bs)
    expected = torch.where(lengths > 0, slot_mapping(tables[:n], torch.arange(n), positions, bs), -1)
    assert torch.equal(slots, expected) and slots.dtype == torch.int64
    assert torch.equal(lengths32, lengths.to(torch.int32)) and lengths32.dtype == torch.int32
