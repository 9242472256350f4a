"""Triton paged attention (decode split-K, varlen prefill/extend, mixed batches, the backend) against torch
references, in the interpreter on CPU. Block tables are scattered, contexts cross block boundaries, GQA groups
include a non-power-of-2 size."""

import pytest
import torch

from shardserve.kernels.paged_decode import choose_num_splits, paged_decode_attention, paged_decode_attention_ref
from shardserve.kernels.prefill import paged_prefill_attention, paged_prefill_attention_ref
from shardserve.kernels.torch_backend import store_kv as store_kv_ref
from shardserve.kernels.triton_backend import TritonAttentionBackend
from _paged_batch import make_batch  # tests/kernels is on sys.path (pytest rootdir-less "prepend" import)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
SCALE = 0.3


def _torch_backend():
    return pytest.importorskip("shardserve.kernels.torch_backend").TorchAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 32), (6, 2, 24), (4, 4, 16)])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    q, _, _, k_cache, v_cache, meta = make_batch(
        [1, 1, 1], [1, 17, 70], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=8, dtype=dtype, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("num_splits", [2, 4, 7])
def test_decode_split_k_merges_to_the_same_result(num_splits):
    # 300 keys = 5 tiles of 64: with 4 or 7 splits some splits are empty and must not disturb the merge
    q, _, _, k_cache, v_cache, meta = make_batch(
        [1, 1], [300, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
        device=DEVICE, seed=1)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_blocks_of_whole_tiles_matches_reference(block_size, num_splits):
    """KV blocks as large as the kernel's 64-key tile or larger (--block-size 64-256): scattered blocks, contexts
    ending inside a tile, at a tile's end, inside a later block, and one key."""
    q, _, _, k_cache, v_cache, meta = make_batch(
        [1] * 5, [1, 64, 200, 300, 513], num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size,
        dtype=torch.float32, device=DEVICE, seed=4)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_programs_started_longest_first_give_each_sequence_its_own_output(num_splits):
    """order= only changes which sequence a program row attends: under any permutation every output row equals the
    batch-order launch's, bit for bit (a kernel that read a sequence through the order but wrote its result, or
    its splits' partials, in the program row's place would not)."""
    from shardserve.kernels.decode_order import longest_first

    q, _, _, k_cache, v_cache, meta = make_batch(
        [1] * 5, [17, 300, 5, 130, 64], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, device=DEVICE, seed=4)
    order = longest_first(meta.seq_lens)
    assert order.tolist() == [1, 3, 4, 0, 2] and order.dtype == torch.int32
    plain = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits)
    ordered = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                     order=order)
    assert torch.equal(ordered, plain)
    shuffled = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                      order=order.flip(0))
    assert torch.equal(shuffled, plain)


def test_triton_backend_ordering_longest_first_attends_like_batch_order():
    """The backend starts the decode kernel's programs longest context first, sorting once a step (the order is kept
    for every layer), and attends as the kernel does in the batch's order."""
    q, k, v, k_cache, v_cache, meta = make_batch(
        [1, 1, 1], [40, 200, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
        device=DEVICE, seed=5)
    ordered = TritonAttentionBackend().attend(q, k_cache, v_cache, meta, SCALE)
    assert meta._derived["order", 3].tolist() == [1, 0, 2]
    splits = choose_num_splits(3, k_cache.shape[2], meta.max_seq_len)
    plain = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, splits)
    assert torch.equal(ordered, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([20, 5], [20, 5]),  # fresh prefills: plain causal
        ([7, 13, 1], [40, 13, 30]),  # extend over a cached prefix, a fresh prefill, a decode: one mixed launch
        ([3, 1, 1], [67, 1, 65]),  # short chunk at the end of a long prefix; decodes on a block boundary
    ],
)
def test_prefill_matches_reference(dtype, query_lens, seq_lens):
    q, _, _, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, dtype=dtype,
        device=DEVICE, seed=2)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **TOL[dtype])


def test_prefill_with_small_query_tiles_spans_many_tiles_per_sequence():
    # block_m 16 with group 4 gives 4 tokens per tile: a 19-token chunk spans 5 tiles, each with its own diagonal
    q, _, _, k_cache, v_cache, meta = make_batch(
        [19, 2], [83, 2], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
        device=DEVICE, seed=3)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    out = paged_prefill_attention(*args, block_m=16)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


def test_prefill_with_non_power_of_2_head_dim_over_long_prefix():
    # head_dim 40 pads to 64 lanes; a 130-key prefix puts two whole key tiles before the chunk (unmasked path)
    q, _, _, k_cache, v_cache, meta = make_batch(
        [2, 9], [132, 9], num_heads=3, num_kv_heads=1, head_dim=40, block_size=16, dtype=torch.float16,
        device=DEVICE, seed=7)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **TOL[torch.float16])


def test_prefill_kernel_on_decode_only_batch_equals_decode_kernel():
    q, _, _, k_cache, v_cache, meta = make_batch(
        [1, 1, 1], [5, 64, 100], num_heads=4, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float32,
        device=DEVICE, seed=4)
    decode = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=2)
    prefill = paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    torch.testing.assert_close(decode, prefill, atol=1e-5, rtol=1e-5)


def test_kernel_references_agree_with_torch_backend():
    """Our per-kernel references are themselves checked against the project's torch backend."""
    backend = _torch_backend()
    q, _, _, k_cache, v_cache, meta = make_batch(
        [4, 1, 9], [12, 30, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
        device=DEVICE, seed=5)
    t_idx = meta.query_start_loc[:-1].long()
    k_new, v_new = k_cache.flatten(0, 1)[meta.slot_mapping], v_cache.flatten(0, 1)[meta.slot_mapping]
    expected = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, SCALE)  # re-stores what is already there
    prefill = paged_prefill_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    torch.testing.assert_close(prefill, expected, atol=1e-5, rtol=1e-5)
    decode = paged_decode_attention_ref(q[t_idx[1:2]], k_cache, v_cache, meta.block_tables[1:2], meta.seq_lens[1:2], SCALE)
    torch.testing.assert_close(decode, expected[t_idx[1:2]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1, 1], [3, 33, 8, 150]), ([6, 1, 2], [6, 20, 41])])
def test_triton_backend_stores_then_attends_like_torch_backend(query_lens, seq_lens):
    backend = _torch_backend()
    q, k, v, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float16,
        device=DEVICE, seed=6)
    meta.slot_mapping[1] = -1  # a padded token: not stored by either backend
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = backend.forward(q, k, v, k_ref, v_ref, meta, SCALE)
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, SCALE)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(out, expected, atol=3e-3, rtol=3e-3)


def test_triton_backend_with_fixed_splits_stays_correct_when_context_grows():
    """A CUDA graph bakes the split count chosen at capture; replays with longer contexts must stay right."""
    backend = TritonAttentionBackend(decode_num_splits=3)
    for seq_len in (2, 130):
        q, k, v, k_cache, v_cache, meta = make_batch(
            [1], [seq_len], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32,
            device=DEVICE, seed=seq_len)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        store_kv_ref(k, v, k_ref, v_ref, meta.slot_mapping)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)
        ref = paged_decode_attention_ref(q, k_ref, v_ref, meta.block_tables, meta.seq_lens, SCALE)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threshold,launches", [(0, {"prefill": 1}), (2, {"decode": 1, "prefill": 1}),
                                                (4, {"prefill": 1})])
def test_split_mixed_sends_the_leading_decodes_to_the_decode_kernel(monkeypatch, threshold, launches):
    """split_mixed_decodes = N: a mixed batch whose first N or more sequences decode runs them on the decode kernel
    and the rest (the third sequence's prefill and every sequence after it, decodes too) on the prefill kernel;
    the result is the single launch's. Off (0), or fewer leading decodes than N: one prefill launch."""
    import shardserve.kernels.triton_backend as tb

    q, k, v, k_cache, v_cache, meta = make_batch(
        [1, 1, 7, 1, 12], [40, 3, 30, 17, 12], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
        dtype=torch.float32, device=DEVICE, seed=9)
    store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    calls = {}
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(tb, name)

        def counted(*args, _real=real, _key=name.split("_")[1], **kwargs):
            calls[_key] = calls.get(_key, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(tb, name, counted)
    out = tb.TritonAttentionBackend(split_mixed=threshold).attend(q, k_cache, v_cache, meta, SCALE)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      SCALE)
    assert calls == launches
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_tail_of_a_mixed_batch_is_fresh_16_byte_aligned_tensors():
    """AttentionMetadata.tail(first) (the prefill half of a split mixed batch): the same values as the slices, in
    tensors of their own, 16-byte aligned for any first (a view of seq_lens from sequence 3 on is 12 bytes off, and
    Triton compiles a kernel anew for each pointer alignment)."""
    *_, meta = make_batch([1, 1, 1, 7, 1, 12], [40, 3, 9, 30, 17, 12], num_heads=4, num_kv_heads=2, head_dim=32,
                          block_size=8, dtype=torch.float32, device=DEVICE, seed=3)
    assert meta.seq_lens[3:].data_ptr() % 16 != 0  # what a view would hand the kernel
    query_start_loc, seq_lens, block_tables = meta.tail(3)
    assert torch.equal(query_start_loc, meta.query_start_loc[3:] - 3)
    assert torch.equal(seq_lens, meta.seq_lens[3:]) and torch.equal(block_tables, meta.block_tables[3:])
    assert all(t.data_ptr() % 16 == 0 for t in (query_start_loc, seq_lens, block_tables))
    assert meta.tail(3)[1] is seq_lens  # computed once a step, for every layer
