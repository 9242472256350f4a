"""The one-row decoder layer's kernels (kernels/gemv.py: gemv_fused; kernels/rope.py with a KVWrite) against the
separate kernels they replace, and the layer itself: a one-token decode through a tiny Llama/Qwen3 with the one-row
path forced on gives the logits and the cache of the torch layers (interpreter on CPU, compiled in the GPU suite)."""

import pytest
import torch

from shardserve.kernels.silu_and_mul import silu_and_mul
from shardserve.kernels.gemv import gemv, gemv_fused
from shardserve.kernels.kv_fp8 import FP8_DTYPE
from shardserve.kernels.rmsnorm import rms_norm
from shardserve.kernels.rope import apply_rope_
from shardserve.kernels.store_kv import KVWrite, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [96, 200])  # 200: K not a power of 2, the norm's reduction block masked
def test_gemv_with_norm_reads_rms_norm_of_x(dtype, k):
    gen = torch.Generator().manual_seed(k)
    h = (torch.randn(1, k, generator=gen) * 3).to(dtype=dtype, device=DEVICE)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(40, k, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    fused = gemv_fused(h, w, norm=(g, 1e-6), block_n=16, block_k=64)
    torch.testing.assert_close(fused, gemv(rms_norm(h, g, 1e-6), w, block_n=16, block_k=64), **_tol(dtype))
    assert not torch.allclose(fused.float(), gemv(h, w, block_n=16, block_k=64).float(), atol=0.1)  # it did normalise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_with_silu_and_residual_is_down_projection_plus_residual(dtype):
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(1, 2 * 150, generator=gen) * 2).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(33, 150, generator=gen) * 0.1).to(dtype=dtype, device=DEVICE)
    residual = torch.randn(1, 33, generator=gen).to(dtype=dtype, device=DEVICE)
    fused = gemv_fused(gate_up, w, silu=True, residual=residual, block_n=16, block_k=64)
    plain = (gemv(silu_and_mul(gate_up), w, block_n=16, block_k=64).float() + residual.float()).to(dtype)
    torch.testing.assert_close(fused, plain, **_tol(dtype))


def test_gemv_fused_refuses_mismatched_inputs():
    x = torch.zeros(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="pick one"):
        gemv_fused(x, torch.zeros(4, 4, device=DEVICE), norm=(torch.ones(4, device=DEVICE), 1e-6), silu=True)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_fused(x, torch.zeros(4, 8, device=DEVICE), norm=(torch.ones(5, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        gemv_fused(x, torch.zeros(4, 8, device=DEVICE), residual=torch.zeros(1, 5, device=DEVICE))


@pytest.mark.parametrize("cache", ["fp16", "fp8"])
def test_rope_writing_the_cache_equals_rope_then_store_kv(cache):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim, blocks, block_size = 5, 4, 3, 32, 6, 4  # 3 KV heads: a masked head block
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(torch.float16).to(DEVICE)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    positions = torch.tensor([0, 9, 3, 63, 17], device=DEVICE)
    slots = torch.tensor([5, -1, 23, 0, 12], device=DEVICE)  # -1: not stored
    cache_dtype = FP8_DTYPE if cache == "fp8" else torch.float16
    scales = (torch.tensor([0.01, 0.02, 0.005], device=DEVICE), torch.tensor([0.02, 0.01, 0.03], device=DEVICE))
    scales = scales if cache == "fp8" else (None, None)
    norms = (torch.rand(dim, generator=gen).to(torch.float16).to(DEVICE) + 0.5,) * 2

    def run(fused: bool):
        q_k_v = qkv.clone()
        q = q_k_v[:, : heads * dim].view(tokens, heads, dim)
        k = q_k_v[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        v = q_k_v[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        k_cache = torch.zeros(blocks, block_size, kv_heads, dim, device=DEVICE).to(cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        write = KVWrite(v, k_cache, v_cache, slots, *scales)
        apply_rope_(positions, q, k, cos, sin, norms, 1e-6, write if fused else None)
        if not fused:
            store_kv(k, v, k_cache, v_cache, slots, *scales)
        return q.clone(), k_cache, v_cache

    q_fused, k_fused, v_fused = run(True)
    q_plain, k_plain, v_plain = run(False)
    assert torch.equal(q_fused, q_plain)
    assert torch.equal(k_fused.view(torch.uint8), k_plain.view(torch.uint8))
    assert torch.equal(v_fused.view(torch.uint8), v_plain.view(torch.uint8))
    assert int((k_fused.float().abs().sum((2, 3)) > 0).sum()) == 4  # four tokens stored, slot -1 nowhere


@pytest.mark.parametrize("x_e4m3", [False, True])
def test_gemv_reads_e4m3_weights_with_their_scales(x_e4m3):
    """quantization="fp8": the GEMV widens e4m3 weights and applies each output channel's scale (and an e4m3 x's
    row scales): the float32 product of the widened operands."""
    from shardserve.kernels.fp8_linear import quantize_rows_ref, quantize_weight

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 200, generator=gen).to(DEVICE)
    wq, w_scale = quantize_weight((torch.randn(37, 200, generator=gen) * 0.1).to(DEVICE))
    w = wq.float() * w_scale.t()
    if x_e4m3:
        xq, x_scale = quantize_rows_ref(x)
        out = gemv(xq, wq, block_n=16, block_k=64, weight_scale=w_scale, x_scale=x_scale, out_dtype=torch.float32)
        ref = (xq.float() * x_scale) @ w.t()
    else:
        out = gemv(x, wq, block_n=16, block_k=64, weight_scale=w_scale)
        ref = x @ w.t()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scales"):
        gemv(x, wq)  # an e4m3 weight without its scales


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_one_row_decode_equals_the_layer_by_layer_path(arch, backend_name, tmp_path, monkeypatch):
    from shardserve.kernels.torch_backend import TorchAttentionBackend
    from shardserve.kernels.triton_backend import TritonAttentionBackend

    backend = TorchAttentionBackend() if backend_name == "torch" else TritonAttentionBackend()
    config, model = _tiny_model(tmp_path, arch, backend)
    _one_row_against_plain(config, model, model, monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_row_decode_with_fp8_weights_reads_them_unquantized_activations(arch, tmp_path, monkeypatch):
    """quantization="fp8" at one row: the layer's GEMVs read the e4m3 weights with their scales and the activations
    as they are (W8A16; gemv.py), i.e. the layer-by-layer path of a model whose weights are the widened e4m3 ones."""
    from shardserve.kernels.fp8_linear import quantize_weight
    from shardserve.kernels.triton_backend import TritonAttentionBackend
    from shardserve.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

    config, fp8 = _tiny_model(tmp_path, arch, TritonAttentionBackend())
    _, widened = _tiny_model(tmp_path, arch, TritonAttentionBackend())
    fp8.quantize_weights_fp8()
    for layer in widened.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            wq, scale = quantize_weight(layer.weight.data)
            layer.weight.data = wq.float() * scale.t()
    assert fp8.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    _one_row_against_plain(config, widened, fp8, monkeypatch)


def _tiny_model(tmp_path, arch, backend):
    from transformers import AutoConfig

    from shardserve.worker.loader import load_weights
    from shardserve.worker.models.registry import build_model
    from tests.hf_reference import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    config = AutoConfig.from_pretrained(folder)
    model = build_model(config, torch.float32, torch.device(DEVICE), backend)
    load_weights(model, folder)
    return config, model


def _one_row_against_plain(config, plain_model, one_row_model, monkeypatch):
    """A one-token decode through plain_model's torch layers and through one_row_model's one-row layers (forced
    on): the same logits and caches."""
    from shardserve.worker.layers import _fused
    from tests.kernels._paged_batch import make_batch

    _, _, _, k_cache, v_cache, meta = make_batch([1], [9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                                 dtype=torch.float32, device=DEVICE)
    input_ids, positions = torch.tensor([42], device=DEVICE), torch.tensor([8], device=DEVICE)
    one_row_layers = []
    original = type(one_row_model.model.layers[0]).forward_one_row

    def counted(self, *args):
        one_row_layers.append(self)
        return original(self, *args)

    def forward(one_row: bool):  # the plain path: torch layers, the backend storing K/V itself
        model = one_row_model if one_row else plain_model
        monkeypatch.setattr(_fused, "use_fused", lambda x: one_row)
        monkeypatch.setattr(_fused, "one_row", lambda x: one_row and x.shape[0] == 1)
        monkeypatch.setattr(type(model.model.layers[0]), "forward_one_row", counted)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(config.num_hidden_layers)]
        with torch.inference_mode():
            return model.compute_logits(model(input_ids, positions, caches, meta)), caches

    (plain, plain_caches), (fused, fused_caches) = forward(False), forward(True)
    assert len(one_row_layers) == config.num_hidden_layers  # every layer took the one-row path, once
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    for (k_p, v_p), (k_f, v_f) in zip(plain_caches, fused_caches):
        torch.testing.assert_close(k_f, k_p, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_f, v_p, atol=1e-5, rtol=1e-5)
    assert not torch.equal(plain_caches[0][0], k_cache)  # the step stored its K


@pytest.mark.parametrize("reading", ["plain", "plain_split_k", "norm", "silu_residual"])
def test_flat_gemv_sums_lane_by_lane_to_the_same_result(reading, monkeypatch):
    """The FLAT GEMV (one row, its products summed lane by lane over K; gemv.FLAT): the reduced GEMV's
    result within float32 rounding, over several K steps and a masked tail. (Products summed a group at a time
    first, as for e4m3 weights: test_one_row_decode_with_fp8_weights_reads_them_unquantized_activations.)"""
    from shardserve.kernels import gemv as gemv_module

    gen = torch.Generator().manual_seed(11)
    k = 300
    x = torch.randn(1, 2 * k if reading == "silu_residual" else k, generator=gen).to(DEVICE)
    w = (torch.randn(37, k, generator=gen) * 0.1).to(DEVICE)
    kwargs = {"norm": ((torch.rand(k, generator=gen) + 0.5).to(DEVICE), 1e-6)} if reading == "norm" else {}
    if reading == "silu_residual":
        kwargs = {"silu": True, "residual": torch.randn(1, 37, generator=gen).to(DEVICE)}
    # plain_split_k: two programs along K, each loading ahead only within its own part
    run = (lambda x, w, **launch: gemv(x, w, split_k=2, **launch)) if reading == "plain_split_k" else gemv_fused
    monkeypatch.setattr(gemv_module, "FLAT", "0")
    reduced = run(x, w, block_n=16, block_k=64, **kwargs)
    monkeypatch.setattr(gemv_module, "FLAT", "1")
    flat = run(x, w, block_n=16, block_k=64, **kwargs)
    torch.testing.assert_close(flat, reduced, atol=1e-5, rtol=1e-5)
    assert flat.abs().max() > 0.1


def test_flat_gemv_is_chosen_for_the_one_row_layer_reads(monkeypatch):
    """gemv.FLAT = "auto" (the only value outside tests) takes the FLAT variant where it was timed faster (the one-row
    layer's reads: through the norm, through SiLU, adding the residual) and not for the plain GEMV (the LM head,
    where it was slower), nor for more than one row."""
    from shardserve.kernels import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "FLAT", "auto")
    for reading in ({"norm": True}, {"silu": True}, {"residual": True}):
        assert gemv_module._flat(1, **({"norm": False, "silu": False, "residual": False} | reading))
        assert not gemv_module._flat(2, **({"norm": False, "silu": False, "residual": False} | reading))
    assert not gemv_module._flat(1, norm=False, silu=False, residual=False)
    monkeypatch.setattr(gemv_module, "FLAT", "1")
    assert gemv_module._flat(1, norm=False, silu=False, residual=False)
    monkeypatch.setattr(gemv_module, "FLAT", "0")
    assert not gemv_module._flat(1, norm=True, silu=False, residual=True)
