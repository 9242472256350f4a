"""GPU suite: the Triton kernels in bf16 on realistic shapes (Qwen3-0.6B / Llama-3-8B attention per rank)
against float32 torch references, within bf16 tolerance. Runs only on a CUDA host (make test-gpu)."""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # skip before importing triton kernels (CPU CI runs them interpreted elsewhere)
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from _paged_batch import make_batch  # noqa: E402

from shardserve.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from shardserve.kernels.prefill import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from shardserve.kernels.rmsnorm import add_rms_norm, rms_norm_ref  # noqa: E402
from shardserve.kernels.rope import apply_rope_, rope_ref  # noqa: E402
from shardserve.kernels.store_kv import store_kv  # noqa: E402
from shardserve.kernels.torch_backend import store_kv as store_kv_ref  # noqa: E402
from shardserve.kernels.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
BF16 = dict(atol=2e-2, rtol=2e-2)
HEADS = {"qwen3-0.6b": (16, 8, 128), "llama-3-8b": (32, 8, 128), "llama-3-8b-tp2": (16, 4, 128)}


def _float_ref(fn, *tensors, **kw):
    """Runs a reference on float32 copies of bf16 inputs: the truth the bf16 kernel is held to."""
    return fn(*[t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors], **kw)


@pytest.mark.parametrize("model", list(HEADS))
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_bf16_batch_64_mixed_contexts(model, num_splits):
    heads, kv_heads, dim = HEADS[model]
    seq_lens = [int(x) for x in torch.randint(1, 2048, (64,), generator=torch.Generator().manual_seed(0))]
    q, _, _, kc, vc, meta = make_batch([1] * 64, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                       block_size=16, dtype=torch.bfloat16, device="cuda")
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, dim**-0.5, num_splits=num_splits)
    ref = _float_ref(paged_decode_attention_ref, q, kc, vc, meta.block_tables, meta.seq_lens, dim**-0.5)
    torch.testing.assert_close(out.float(), ref, **BF16)


def test_decode_bf16_long_context_split_k():
    q, _, _, kc, vc, meta = make_batch([1, 1], [16384, 9000], num_heads=32, num_kv_heads=8, head_dim=128,
                                       block_size=16, dtype=torch.bfloat16, device="cuda")
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 128**-0.5, num_splits=16)
    ref = _float_ref(paged_decode_attention_ref, q, kc, vc, meta.block_tables, meta.seq_lens, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, **BF16)


@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3-8b"])
def test_prefill_bf16_mixed_batch(model):
    heads, kv_heads, dim = HEADS[model]
    query_lens = [1000, 300, 17, 1, 1, 1, 256]
    seq_lens = [1000, 1500, 2048, 700, 1, 4000, 256]  # fresh, extend over a prefix, chunk, decodes
    q, _, _, kc, vc, meta = make_batch(query_lens, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                       block_size=16, dtype=torch.bfloat16, device="cuda")
    args = (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, dim**-0.5)
    out = paged_prefill_attention(*args)
    ref = _float_ref(paged_prefill_attention_ref, *args)
    torch.testing.assert_close(out.float(), ref, **BF16)


def test_backend_bf16_decode_and_mixed_steps_store_then_attend():
    backend = TritonAttentionBackend()
    for query_lens, seq_lens in (([1] * 32, [100 + 37 * i for i in range(32)]), ([128, 1, 1], [640, 90, 1])):
        q, k, v, kc, vc, meta = make_batch(query_lens, seq_lens, num_heads=16, num_kv_heads=8, head_dim=128,
                                           block_size=16, dtype=torch.bfloat16, device="cuda", seed=1)
        kr, vr = kc.clone(), vc.clone()
        store_kv_ref(k, v, kr, vr, meta.slot_mapping)
        out = backend.forward(q, k, v, kc, vc, meta, 128**-0.5)
        assert torch.equal(kc, kr) and torch.equal(vc, vr)
        ref = _float_ref(paged_prefill_attention_ref, q, kr, vr, meta.query_start_loc, meta.seq_lens,
                         meta.block_tables, 128**-0.5)
        torch.testing.assert_close(out.float(), ref, **BF16)


def test_store_kv_bf16_cache_past_int32_offsets():
    blocks = 140_000  # 140000 * 16 * 8 * 128 elements > 2^31: slot offsets must be computed in int64
    kc = torch.zeros(blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(blocks * 16, device="cuda")[:512]
    slots[0] = blocks * 16 - 1  # the very last slot
    slots[1::7] = -1
    store_kv(k, v, kc, vc, slots)
    kept = slots >= 0
    assert torch.equal(kc.view(-1, 8, 128)[slots[kept]], k[kept])
    assert torch.equal(vc.view(-1, 8, 128)[slots[kept]], v[kept])
    assert int((kc.view(-1, 1024) != 0).any(1).sum()) == int(kept.sum())  # nothing written elsewhere


@pytest.mark.parametrize("hidden", [1024, 4096])
def test_add_rms_norm_bf16(hidden):
    x = torch.randn(257, hidden, dtype=torch.bfloat16, device="cuda")
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    out, new_res = add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **BF16)


def test_rope_bf16_llama_shapes():
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv_freq)
    q = torch.randn(300, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(300, 8, 128, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 8192, (300,), device="cuda")
    q_ref, k_ref = rope_ref(positions, q, k, freqs.cos(), freqs.sin())
    apply_rope_(positions, q, k, freqs.cos(), freqs.sin())
    torch.testing.assert_close(q, q_ref, **BF16)
    torch.testing.assert_close(k, k_ref, **BF16)


@pytest.mark.parametrize("width", [3072, 14336])  # Qwen3-0.6B and Llama-3-8B intermediate sizes
def test_silu_and_mul_bf16(width):
    from shardserve.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    gate_up = torch.randn(257, 2 * width, dtype=torch.bfloat16, device="cuda") * 3
    torch.testing.assert_close(silu_and_mul(gate_up).float(), _float_ref(silu_and_mul_ref, gate_up), **BF16)


def test_rope_with_qk_norm_bf16_qwen3_shapes():
    from shardserve.kernels.rmsnorm import rms_norm_ref

    tokens, heads, kv_heads, dim = 300, 16, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda") * 2
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    wq = torch.rand(dim, dtype=torch.bfloat16, device="cuda") + 0.5
    wk = torch.rand(dim, dtype=torch.bfloat16, device="cuda") + 0.5
    inv_freq = 1.0 / 1000000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv_freq)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    q_ref, k_ref = rope_ref(positions, _float_ref(rms_norm_ref, q, wq, 1e-6), _float_ref(rms_norm_ref, k, wk, 1e-6),
                            freqs.cos(), freqs.sin())
    apply_rope_(positions, q, k, freqs.cos(), freqs.sin(), (wq, wk), 1e-6)
    torch.testing.assert_close(q.float(), q_ref, **BF16)
    torch.testing.assert_close(k.float(), k_ref, **BF16)


def test_gumbel_sampler_matches_its_reference_at_qwen3_vocabulary():
    from shardserve.kernels.sampling import gumbel_sample, gumbel_sample_ref, split_keys

    logits = (torch.randn(256, 151936, device="cuda") * 4).to(torch.bfloat16)
    logits[::7, 1000:] = float("-inf")  # some rows restricted to their first 1000 tokens
    keys = torch.tensor(split_keys([(0x9E3779B97F4A7C15 * (i + 1)) % 2**64 for i in range(256)]),
                        dtype=torch.int64, device="cuda").view(-1, 2)
    inv_t = torch.linspace(0.5, 3.0, 256, device="cuda")
    tokens = gumbel_sample(logits, keys, inv_t)
    assert torch.equal(tokens, gumbel_sample_ref(logits, keys, inv_t))
    assert int(tokens[::7].max()) < 1000


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (1024, 2048), (1024, 3072)])
def test_gemv_bf16_one_row_equals_cublas_and_the_layers_take_it(n, k, monkeypatch):
    """The one-row GEMV (kernels/gemv.py) on Llama-3-8B's and Qwen3-0.6B's shapes against F.linear within bf16
    rounding of a float32 sum, and worker/layers/linear.matmul dispatching one row to it (and two rows not)."""
    from shardserve.kernels import gemv as gemv_module
    from shardserve.worker.layers import linear

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(2, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    expected = x.float() @ w.float().T
    torch.testing.assert_close(gemv_module.gemv(x[:1], w, 8, 1024, 4).float(), expected[:1], **BF16)
    calls = []
    def counted(x_, w_, *args, **kwargs):
        calls.append(x_.shape)
        return torch.nn.functional.linear(x_, w_)
    monkeypatch.setattr(gemv_module, "gemv", counted)
    linear.matmul(x[:1], w)
    linear.matmul(x, w)
    assert calls == [torch.Size([1, k])]


def test_the_pdl_chain_computes_what_plain_launches_do(monkeypatch):
    """The PDL chain (kernels/pdl.py, on by default): a bs=1 layer's chain (GEMV, RoPE writing the cache, decode attention
    over 8 splits and their merge, GEMV), then the residual add + RMSNorm, a cuBLAS GEMM, SiLU-and-mul and another,
    launched as programmatic dependents, eagerly and replayed in a CUDA graph, gives bit for bit what plain launches
    give: each kernel waits for the one before it before its first load."""
    from shardserve.kernels import pdl
    from shardserve.kernels.silu_and_mul import silu_and_mul
    from shardserve.kernels.gemv import gemv
    from shardserve.kernels.rmsnorm import add_rms_norm
    from shardserve.kernels.store_kv import KVWrite

    heads, kv_heads, dim = HEADS["llama-3-8b"]
    _, _, _, kc0, vc0, meta = make_batch([1], [700], num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                          block_size=16, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    w_qkv = torch.randn((heads + 2 * kv_heads) * dim, heads * dim, generator=gen, device="cuda").bfloat16() * 0.02
    w_o = torch.randn(heads * dim, heads * dim, generator=gen, device="cuda").bfloat16() * 0.02
    x = torch.randn(1, heads * dim, generator=gen, device="cuda").bfloat16()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    freqs = torch.outer(torch.arange(2048, device="cuda").float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([699], device="cuda")
    slot = meta.block_tables[0, 699 // 16].long() * 16 + 699 % 16

    norm_w = 1.0 + 0.1 * torch.randn(heads * dim, generator=gen, device="cuda").bfloat16()
    w_gate_up = torch.randn(2048, heads * dim, generator=gen, device="cuda").bfloat16() * 0.02
    w_down = torch.randn(heads * dim, 1024, generator=gen, device="cuda").bfloat16() * 0.02

    def layer(kc, vc):
        qkv = gemv(x, w_qkv).view(1, heads + 2 * kv_heads, dim)
        q, k, v = (t.contiguous() for t in qkv.split([heads, kv_heads, kv_heads], dim=1))
        apply_rope_(positions, q, k, cos, sin, write=KVWrite(v, kc, vc, slot.view(1), None, None))
        attn = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, dim**-0.5, num_splits=8)
        hidden, residual = add_rms_norm(gemv(attn.view(1, -1), w_o), x, norm_w, 1e-6)
        up = silu_and_mul(torch.nn.functional.linear(hidden.repeat(8, 1), w_gate_up))  # 8 rows: cuBLAS
        return torch.cat([torch.nn.functional.linear(up, w_down), residual])

    monkeypatch.setattr(pdl, "CHAIN", False)
    plain_k, plain_v = kc0.clone(), vc0.clone()
    plain = layer(plain_k, plain_v)
    monkeypatch.setattr(pdl, "CHAIN", True)
    chained_k, chained_v = kc0.clone(), vc0.clone()
    assert torch.equal(layer(chained_k, chained_v), plain)
    assert torch.equal(chained_k, plain_k) and torch.equal(chained_v, plain_v)
    graph_k, graph_v = kc0.clone(), vc0.clone()
    layer(graph_k, graph_v)  # warm: every kernel compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(graph_k, graph_v)
    graph_k.copy_(kc0), graph_v.copy_(vc0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain) and torch.equal(graph_k, plain_k)
