"""The torch attention backend against a naive dense softmax attention, on random paged layouts.

Covers decode-only batches, prefills over a cached prefix (prefix-cache hit / chunked prefill), batches
mixing both, GQA, and slot -1 (a token whose K/V must not be written).
"""

from __future__ import annotations

import random

import pytest
import torch

from shardserve.kernels.backends import AttentionMetadata
from shardserve.kernels.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 40


def naive_attention(q, k, v, scale):
    """q [q_len, H, D] at the last q_len positions of k/v [L, KVH, D]; causal."""
    q_len, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(length)[None, :] <= torch.arange(length - q_len, length)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(contexts: list[int], query_lens: list[int], seed: int):
    """Sequence i has contexts[i] tokens in total, the last query_lens[i] new this step; earlier ones already cached."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    full_k, full_v, tables, slots = [], [], [], []
    for length, q_len in zip(contexts, query_lens):
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        tables.append(table)
        keys, values = torch.randn(length, KV_HEADS, DIM), torch.randn(length, KV_HEADS, DIM)
        full_k.append(keys)
        full_v.append(values)
        for pos in range(length):
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            if pos < length - q_len:  # the cached prefix, written by earlier steps
                k_cache.view(-1, KV_HEADS, DIM)[slot] = keys[pos]
                v_cache.view(-1, KV_HEADS, DIM)[slot] = values[pos]
            else:
                slots.append(slot)
    width = max(map(len, tables))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(contexts),
        max_query_len=max(query_lens),
        max_seq_len=max(contexts),
    )
    q = torch.randn(starts[-1], HEADS, DIM)
    new_k = torch.cat([k[-n:] for k, n in zip(full_k, query_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(full_v, query_lens)])
    return q, new_k, new_v, k_cache, v_cache, meta, full_k, full_v, starts


@pytest.mark.parametrize(
    "contexts, query_lens",
    [
        ([5, 17, 1, 9], [1, 1, 1, 1]),  # decode-only batch
        ([12], [12]),  # plain prefill
        ([13], [6]),  # prefill over a cached prefix (prefix hit or second chunk)
        ([9, 20, 3, 8], [1, 7, 3, 1]),  # mixed: decodes around a chunk and a whole prefill
    ],
)
def test_reference_backend_equals_dense_attention(contexts, query_lens):
    q, k, v, k_cache, v_cache, meta, full_k, full_v, starts = run_case(contexts, query_lens, seed=sum(contexts))
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale=DIM**-0.5)
    for i in range(len(contexts)):
        expected = naive_attention(q[starts[i] : starts[i + 1]], full_k[i], full_v[i], DIM**-0.5)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_slot_minus_one_is_not_written():
    q, k, v, k_cache, v_cache, meta, *_ = run_case([6, 3], [2, 1], seed=3)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    meta.slot_mapping[1] = -1  # the second new token of sequence 0 is padding
    TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale=1.0)
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    changed = (k_cache != before_k).reshape(-1, KV_HEADS * DIM).any(-1).nonzero().flatten()
    assert set(changed.tolist()) == set(written.tolist())
    assert torch.equal((v_cache != before_v).reshape(-1, KV_HEADS * DIM).any(-1).nonzero().flatten(), changed)
