"""The two-item decode kernel (kernels/paged_decode_paired.py) against the one-item kernel and the torch reference,
in the interpreter on CPU: every (sequence, KV head) item is attended once and written to its own rows, whichever
program holds it (the first or the second item, the middle program of an odd count alone), in batch order and in
any launch order, over bf16-layout and FP8 (int16 pairs) caches; a padding row with no keys gives zeros."""

import pytest
import torch

from shardserve.kernels.decode_order import longest_first
from shardserve.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from _paged_batch import make_batch  # tests/kernels is on sys.path
from test_fp8_kv import fp8_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (6, 2), (4, 4)])  # 1 KV head: odd item counts
@pytest.mark.parametrize("lens", [[1, 150, 17], [300, 5, 64, 129, 16]])
def test_paired_decode_attends_every_item_once(num_heads, num_kv_heads, lens):
    q, _, _, k_cache, v_cache, meta = make_batch([1] * len(lens), lens, num_heads=num_heads,
                                                 num_kv_heads=num_kv_heads, head_dim=32, block_size=8,
                                                 dtype=torch.float32, device=DEVICE, seed=len(lens))
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, 1)
    ref = paged_decode_attention_ref(*args[:6])
    one = paged_decode_attention(*args, paired=False)
    for order in (None, longest_first(meta.seq_lens), longest_first(meta.seq_lens).flip(0)):
        paired = paged_decode_attention(*args, paired=True, order=order, block_n=32)
        torch.testing.assert_close(paired, ref, atol=1e-4, rtol=1e-4)
        # the same tiles in the same order as the one-item kernel's
        torch.testing.assert_close(paged_decode_attention(*args, paired=True, order=order), one, atol=1e-6, rtol=1e-6)


def test_paired_decode_gives_zeros_for_a_row_without_keys_and_leaves_its_neighbours_right():
    lens = [40, 1, 77]
    q, _, _, k_cache, v_cache, meta = make_batch([1] * 3, lens, num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=8, dtype=torch.float32, device=DEVICE, seed=2)
    meta.seq_lens[1] = 0  # a CUDA graph's padding row
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, 1, out=out, paired=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    ref = paged_decode_attention_ref(q[keep], k_cache, v_cache, meta.block_tables[keep], meta.seq_lens[keep], SCALE)
    torch.testing.assert_close(out[keep], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_paired_decode_reads_an_fp8_cache_with_each_items_scales(num_kv_heads):
    """Pairs join items of different KV heads (scales orders of magnitude apart): a scale taken from the wrong
    item shows."""
    lens = [3, 150, 17, 64, 201]
    q, _, _, k8, v8, meta, ks, vs = fp8_batch([1] * len(lens), lens, num_heads=2 * num_kv_heads,
                                              num_kv_heads=num_kv_heads, head_dim=32, dtype=torch.float16, seed=3)
    args = (q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, 1)
    ref = paged_decode_attention_ref(*args[:6], ks, vs)
    one = paged_decode_attention(*args, k_scale=ks, v_scale=vs, paired=False)
    paired = paged_decode_attention(*args, k_scale=ks, v_scale=vs, paired=True, order=longest_first(meta.seq_lens))
    assert ((paired.float() - ref.float()).abs() <= 1e-2 * 300 + 1e-2 * ref.float().abs()).all()
    torch.testing.assert_close(paired, one, atol=0, rtol=0)
