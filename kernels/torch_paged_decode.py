"""Decode attention (one query per sequence) that reads the paged cache in place, in plain torch: the CPU path.

The gather formulation copies every sequence's blocks into a dense [B, kv_heads, L, D] tensor per layer and step
(for a batch of 32 x ~400 tokens that is ~16 MB written and read again per layer) before one SDPA call. Here the
cache is never copied: it is viewed as rows, [num_slots * kv_heads, head_dim], and each (sequence, query head) is
a "bag" of the rows its keys and values sit in, the same index for K and V and for every layer of the step
(`DecodeIndex`, built once per step from the block tables). Then, with flat scores over all bags:

    scores = <q[bag], k_row> for every entry   aten._embedding_bag_per_sample_weights_backward (one dot per entry,
                                                read from the cache where it lies)
    w      = exp(score - max of its bag)        segment_reduce max, then sum (float32)
    out    = sum over a bag of w * v_row        embedding_bag(mode="sum", per_sample_weights=w) (a weighted row sum
             / sum over the bag of w            read from the cache where it lies), then one division per bag

A fixed number of ops per layer whatever the batch, no padding, no mask. Used for float32 caches (the scores come
out in the cache's dtype, and bfloat16 scores would lose the precision SDPA keeps in its float32 accumulators);
other dtypes and the FP8 cache keep the gather + SDPA path (torch_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeIndex:
    """Which cache rows each (sequence, query head) reads: bag b = seq * num_heads + head holds entries
    offsets[b] .. offsets[b] + lengths[b] - 1, one per context position, in position order."""

    rows: torch.Tensor  # [N] int64: slot * num_kv_heads + kv_head, a row of the cache viewed [-1, head_dim]
    offsets: torch.Tensor  # [B * H] int64: first entry of each bag
    lengths: torch.Tensor  # [B * H] int64: context length of the bag's sequence
    bag_of: torch.Tensor  # [N] int64: the bag of each entry


def build_decode_index(block_tables: torch.Tensor, seq_lens: list[int], block_size: int, num_heads: int,
                       num_kv_heads: int) -> DecodeIndex:
    """block_tables [B, max_blocks] (the decoding sequences' rows), seq_lens their context lengths (>= 1)."""
    device = block_tables.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    batch = len(seq_lens)
    # every context position of every sequence, sequence-major: its slot in the flattened cache
    seq_of_pos = torch.repeat_interleave(torch.arange(batch, device=device), lens)
    seq_start = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq_of_pos.numel(), device=device) - seq_start[seq_of_pos]
    blocks = block_tables.long()[seq_of_pos, pos // block_size]
    slots = blocks * block_size + pos % block_size  # [sum(lens)]
    # bag (seq, head): that sequence's slots, in the row of the head's KV head
    bag_lens = lens.repeat_interleave(num_heads)  # [B * H]
    bag_of = torch.repeat_interleave(torch.arange(batch * num_heads, device=device), bag_lens)
    offsets = torch.cumsum(bag_lens, 0) - bag_lens
    within = torch.arange(bag_of.numel(), device=device) - offsets[bag_of]
    seq, head = bag_of // num_heads, bag_of % num_heads
    rows = slots[seq_start[seq] + within] * num_kv_heads + head // (num_heads // num_kv_heads)
    return DecodeIndex(rows, offsets, bag_lens, bag_of)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex,
                 scale: float) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, the order of the index's sequences) -> [B, H, D]; caches
    [num_blocks, block_size, kv_heads, D], float32, contiguous."""
    batch, num_heads, head_dim = q.shape
    scores = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        (q * scale).reshape(-1, head_dim), k_cache.view(-1, head_dim), index.rows, index.offsets, index.bag_of,
        0, -1)  # mode 0 = sum, padding_idx -1 = none: scores[e] = <q[bag_of[e]] * scale, k_row[rows[e]]>
    top = torch.segment_reduce(scores, "max", lengths=index.lengths)
    weights = scores.sub_(top.index_select(0, index.bag_of)).exp_()  # softmax numerators
    total = torch.segment_reduce(weights, "sum", lengths=index.lengths)
    out = torch.nn.functional.embedding_bag(index.rows, v_cache.view(-1, head_dim), index.offsets, mode="sum",
                                            per_sample_weights=weights)
    return out.div_(total.unsqueeze(1)).view(batch, num_heads, head_dim)  # normalised per bag: B * H divisions
