"""The in-place CPU decode (kernels/torch_paged_decode.py) against the gather formulation it replaces, on random
caches whose blocks are scattered, with context lengths of one token, partial last blocks and whole blocks, GQA
and plain multi-head, with K in the usual layout and transposed within its blocks (the CPU's float32 cache); the
store through a transposed K; and through the torch backend: the per-step index reused across layers, rebuilt per
step, and decodes mixed with prefills."""

from __future__ import annotations

import os

import pytest
import torch

from shardserve.kernels.torch_backend import TorchAttentionBackend, gather_context, store_kv
from shardserve.kernels.torch_paged_decode import build_decode_index, is_transposed, paged_decode, transposed_k_cache
from tests.kernels._paged_batch import make_batch


def transposed(k_cache: torch.Tensor) -> torch.Tensor:
    """The same keys in the CPU float32 cache's layout (K^T within each block)."""
    out = transposed_k_cache(*k_cache.shape, k_cache.dtype)
    out.copy_(k_cache)
    assert is_transposed(out) and torch.equal(out, k_cache)
    return out


def gathered_reference(q, k_cache, v_cache, meta, scale, seqs=None):
    """Each sequence's context gathered densely (index_select of its blocks), then softmax(q k^T) v in float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    outs = []
    for row, i in enumerate(seqs if seqs is not None else range(meta.num_seqs)):
        keys = gather_context(k_cache, meta.block_tables[i], meta.seq_lens_cpu[i]).double()  # [L, KVH, D]
        values = gather_context(v_cache, meta.block_tables[i], meta.seq_lens_cpu[i]).double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), keys) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(outs).float()


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads",
    [
        ([1, 16, 17, 33, 5, 64, 100, 2], 9, 3),  # one token, whole blocks, partial last blocks; GQA 3:1
        ([250, 3, 129], 4, 4),  # plain multi-head
        ([40], 8, 1),  # one sequence, multi-query
    ],
)
@pytest.mark.parametrize("k_layout", ["usual", "transposed"])
def test_in_place_decode_equals_gathered_attention(seq_lens, heads, kv_heads, k_layout):
    q, _, _, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, num_heads=heads,
                                                 num_kv_heads=kv_heads, head_dim=32, block_size=16,
                                                 dtype=torch.float32, seed=len(seq_lens) + heads)
    kt = k_layout == "transposed"
    index = build_decode_index(meta.block_tables, meta.seq_lens_cpu, 16, heads, kv_heads, 32 if kt else None)
    out = paged_decode(q, transposed(k_cache) if kt else k_cache, v_cache, index, scale=32**-0.5)
    torch.testing.assert_close(out, gathered_reference(q, k_cache, v_cache, meta, 32**-0.5), atol=2e-5, rtol=2e-5)


def test_a_cpu_cache_reads_zeros_and_takes_memory_only_where_written():
    """cache_zeros on the CPU (every backend's new_cache, the torch backend's transposed K and its V too): 512 MiB
    of zeros that do not raise the process's resident memory until written (torch.zeros writes every page at
    once); writes stay; the buffer outlives its maker."""
    import gc

    from shardserve.kernels.backends import AttentionBackend, cache_zeros

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident_mib()
    k_cache, v_cache = AttentionBackend().new_cache(1024, 16, 8, 128, torch.float32, torch.device("cpu"))  # 2 x 64 MiB
    k_torch, v_torch = TorchAttentionBackend().new_cache(1024, 16, 8, 128, torch.float32, torch.device("cpu"))
    big = cache_zeros((64, 1 << 20), torch.float32, "cpu")  # 256 MiB
    gc.collect()
    assert resident_mib() - before < 32, "the caches' pages were written at allocation"
    assert not big[::8, ::4096].any() and not k_cache[::64].any() and not v_cache[::64].any()
    assert is_transposed(k_torch) and not k_torch[::64].any() and not v_torch[::64].any()
    big[3, 5] = 7.0
    k_cache[1023, 15, 7, 127] = 2.0
    assert float(big[3, 5]) == 7.0 and float(k_cache.sum()) == 2.0
    assert cache_zeros((0, 4), torch.float32, "cpu").shape == (0, 4)


def test_the_cpu_float_caches_keep_k_transposed_and_the_store_writes_it_as_the_usual_layout():
    backend = TorchAttentionBackend()
    k_cache, v_cache = backend.new_cache(6, 4, 3, 8, torch.float32, torch.device("cpu"))
    assert k_cache.shape == v_cache.shape == (6, 4, 3, 8) and is_transposed(k_cache) and v_cache.is_contiguous()
    assert is_transposed(backend.new_cache(6, 4, 3, 8, torch.bfloat16, torch.device("cpu"))[0])
    assert backend.new_cache(6, 4, 3, 8, torch.float8_e4m3fn, torch.device("cpu"))[0].is_contiguous()
    k_usual, v_usual = torch.zeros_like(v_cache), torch.zeros_like(v_cache)
    k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    slots = torch.tensor([0, 7, -1, 13, 23])  # first and last slots, a skipped row, scattered blocks
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv(k, v, k_usual, v_usual, slots)
    assert torch.equal(k_cache, k_usual) and torch.equal(v_cache, v_usual) and k_cache.abs().sum() > 0


@pytest.mark.parametrize("k_layout", ["usual", "transposed"])
def test_backend_reuses_the_step_index_across_layers_and_rebuilds_it_per_step(k_layout):
    backend = TorchAttentionBackend()
    seq_lens = [7, 48, 21, 90]
    q, _, _, k_cache, v_cache, meta = make_batch([1] * 4, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                                                 block_size=8, dtype=torch.float32, seed=1)
    layer2_k, layer2_v = torch.randn_like(k_cache), torch.randn_like(v_cache)  # another layer, same step
    if k_layout == "transposed":
        k_cache, layer2_k = transposed(k_cache), transposed(layer2_k)
    for kc, vc in ((k_cache, v_cache), (layer2_k, layer2_v)):
        out = backend.attend(q, kc, vc, meta, scale=0.25)
        torch.testing.assert_close(out, gathered_reference(q, kc, vc, meta, 0.25), atol=2e-5, rtol=2e-5)
    # the next step: the same shapes, other blocks and lengths; a stale index would read the old ones
    q2, _, _, k2, v2, meta2 = make_batch([1] * 4, [9, 47, 30, 88], num_heads=6, num_kv_heads=2, head_dim=16,
                                         block_size=8, dtype=torch.float32, seed=2)
    k2 = transposed(k2) if k_layout == "transposed" else k2
    out = backend.attend(q2, k2, v2, meta2, scale=0.25)
    torch.testing.assert_close(out, gathered_reference(q2, k2, v2, meta2, 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("k_layout", ["usual", "transposed"])
def test_backend_decodes_beside_prefills_read_their_own_rows(k_layout):
    query_lens, seq_lens = [1, 5, 1, 12, 1], [30, 20, 3, 12, 17]
    q, _, _, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=4, dtype=torch.float32, seed=5)
    usual = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale=0.25)
    k_cache = transposed(k_cache) if k_layout == "transposed" else k_cache
    out = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale=0.25)
    decodes, rows = [0, 2, 4], [0, 6, 19]  # the decodes' sequences and their tokens' rows in the flat batch
    expected = gathered_reference(q[rows], k_cache, v_cache, meta, 0.25, seqs=decodes)
    torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, usual, atol=2e-5, rtol=2e-5)  # the prefills' rows read a transposed K too


def eager_attention(q, k_cache, v_cache, meta, scale):
    """Attention as an eager implementation runs it in q's dtype: scores from a matmul in that dtype (rounded to
    it), softmax in float32, the probabilities rounded back to the dtype for the matmul with V."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    outs = []
    for i in range(meta.num_seqs):
        keys = gather_context(k_cache, meta.block_tables[i], meta.seq_lens_cpu[i]).repeat_interleave(
            heads // kv_heads, dim=1).transpose(0, 1)  # [H, L, D]
        values = gather_context(v_cache, meta.block_tables[i], meta.seq_lens_cpu[i]).repeat_interleave(
            heads // kv_heads, dim=1).transpose(0, 1)
        scores = torch.matmul(q[i].unsqueeze(1) * scale, keys.transpose(1, 2))  # [H, 1, L]
        outs.append(torch.matmul(torch.softmax(scores.float(), -1).to(q.dtype), values).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sharpness", [1.0, 3.0])
def test_half_precision_in_place_decode_is_as_close_to_float64_as_an_eager_attention(dtype, sharpness):
    """Half-precision caches round the scores to their dtype (the embedding bag's output), as an eager attention's
    matmul does; SDPA, which keeps them in float32, is closer (docs/architecture.md, "On the CPU")."""
    seq_lens = [1, 16, 17, 70, 300, 129]
    q, _, _, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, num_heads=9, num_kv_heads=3,
                                                 head_dim=64, block_size=16, dtype=dtype, seed=11)
    q = q * sharpness  # sharper attention than randn's: rounding the scores matters more
    reference = gathered_reference(q.double(), k_cache.double(), v_cache.double(), meta, 0.125)
    in_place = TorchAttentionBackend().attend(q, transposed(k_cache), v_cache, meta, scale=0.125)
    assert in_place.dtype == dtype
    error = (in_place.double() - reference).abs().max().item()
    eager_error = (eager_attention(q, k_cache, v_cache, meta, 0.125).double() - reference).abs().max().item()
    assert error <= 1.5 * eager_error + 1e-3, (error, eager_error)
