"""Decode attention (one query per sequence) that reads the paged cache in place, in plain torch: the CPU path.

The gather formulation copies every sequence's blocks into a dense [B, kv_heads, L, D] tensor per layer and step
(for a batch of 32 x ~400 tokens that is ~16 MB written and read again per layer) before one SDPA call. Here the
cache is never copied. Each (sequence, query head) is a "bag" of context positions, and the step's index
(`DecodeIndex`, built once per step from the block tables and shared by every layer) says where they lie.

Scores. On the CPU the torch backend stores K transposed within each block, [num_blocks, kv_heads, head_dim,
block_size] under the usual logical view (`transposed_k_cache`), so that a block's keys of one KV head are head_dim
rows of block_size scores' worth of entries. One query head's scores over one block are then a weighted row sum:

    scores[bag, block] = sum over d of q[bag, d] * K^T[block, kv_head, d, :]      (block_size scores at once)

which is `embedding_bag(mode="sum", per_sample_weights=q)` over the rows of K^T viewed [-1, block_size]: a
vectorised kernel (FBGEMM's on x86) that reads each row once per query head, faster than one dot product per
(position, head). A K cache in the usual layout (tests, caches made by hand) takes that per-entry dot product instead (`_embedding_bag_per_sample_weights_backward`).

Then, in float32:

    w   = exp(score - max of its bag)      the maximum per block, then per bag (segment_reduce over its blocks)
    out = sum over a bag of w * v_row      embedding_bag(mode="sum", per_sample_weights=w) over V viewed as rows
          / sum over the bag of w          [num_slots * kv_heads, head_dim], one division per bag

A fixed number of ops per layer whatever the batch, no padding of the context, no mask beyond each sequence's last
block. The torch backend uses it on the CPU for caches in the model's dtype: float32, and bfloat16/float16 with a
transposed K. In those the embedding bags accumulate in float32 and round their outputs to the cache's dtype: the
scores come out rounded to bfloat16 (as an eager attention's bfloat16 matmul rounds them; the max, exp and sums
then run in float32) and the softmax numerators are rounded to it for V's weighted sum. The FP8 cache keeps the
gather + SDPA path (torch_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.kernels.backends import cache_zeros


def transposed_k_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled K cache of logical shape [num_blocks, block_size, kv_heads, head_dim] whose memory is
    [num_blocks, kv_heads, head_dim, block_size]."""
    return cache_zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype, device).permute(0, 3, 1, 2)


def is_transposed(k_cache: torch.Tensor) -> bool:
    """K laid out as transposed_k_cache makes it (with one-entry blocks both layouts are the same memory)."""
    return not k_cache.is_contiguous() and k_cache.permute(0, 2, 3, 1).is_contiguous()


@dataclass
class DecodeIndex:
    """Which cache rows each (sequence, query head) reads: bag b = seq * num_heads + head holds entries
    offsets[b] .. offsets[b] + lengths[b] - 1, one per context position, in position order."""

    rows: torch.Tensor  # [N] int64: slot * num_kv_heads + kv_head, a row of the cache viewed [-1, head_dim]
    offsets: torch.Tensor  # [B * H] int64: first entry of each bag
    lengths: torch.Tensor  # [B * H] int64: context length of the bag's sequence
    bag_of: torch.Tensor  # [N] int64: the bag of each entry
    blocks: "BlockBags | None" = None  # the K^T formulation's index (a transposed K cache)


@dataclass
class BlockBags:
    """The K^T scores' index: one block bag per (bag, block of its sequence), in bag then block order."""

    rows: torch.Tensor  # [M * head_dim]: (block * kv_heads + kv_head) * head_dim + d, rows of K^T viewed [-1, bs]
    offsets: torch.Tensor  # [M]: each block bag's first entry in rows (M = sum over bags of their blocks)
    bag: torch.Tensor  # [M]: the bag (sequence, head) of each block bag
    per_bag: torch.Tensor  # [B * H]: blocks of each bag
    past_end: torch.Tensor  # [M, block_size] bool: positions beyond the sequence (the last block's tail)
    keep: torch.Tensor  # [N]: the positions inside the sequences in the flattened [M, block_size] scores


def build_decode_index(block_tables: torch.Tensor, seq_lens: list[int], block_size: int, num_heads: int,
                       num_kv_heads: int, head_dim: int | None = None) -> DecodeIndex:
    """block_tables [B, max_blocks] (the decoding sequences' rows), seq_lens their context lengths (>= 1).
    head_dim given: also the index of the K^T scores (a K cache made by transposed_k_cache)."""
    device = block_tables.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    batch = len(seq_lens)
    group = num_heads // num_kv_heads
    # every context position of every sequence, sequence-major: its slot in the flattened cache
    seq_of_pos = torch.repeat_interleave(torch.arange(batch, device=device), lens)
    seq_start = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq_of_pos.numel(), device=device) - seq_start[seq_of_pos]
    tables = block_tables.long()
    slots = tables[seq_of_pos, pos // block_size] * block_size + pos % block_size  # [sum(lens)]
    # bag (seq, head): that sequence's slots, in the row of the head's KV head
    bag_lens = lens.repeat_interleave(num_heads)  # [B * H]
    bag_of = torch.repeat_interleave(torch.arange(batch * num_heads, device=device), bag_lens)
    offsets = torch.cumsum(bag_lens, 0) - bag_lens
    within = torch.arange(bag_of.numel(), device=device) - offsets[bag_of]
    seq, head = bag_of // num_heads, bag_of % num_heads
    rows = slots[seq_start[seq] + within] * num_kv_heads + head // group
    index = DecodeIndex(rows, offsets, bag_lens, bag_of)
    if head_dim is not None:
        index.blocks = _block_bags(tables, lens, block_size, num_heads, num_kv_heads, head_dim)
    return index


def _block_bags(tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_heads: int, num_kv_heads: int,
                head_dim: int) -> BlockBags:
    device = tables.device
    per_bag = ((lens + block_size - 1) // block_size).repeat_interleave(num_heads)  # [B * H]
    bag = torch.repeat_interleave(torch.arange(per_bag.numel(), device=device), per_bag)  # [M]
    first = torch.cumsum(per_bag, 0) - per_bag
    nth = torch.arange(bag.numel(), device=device) - first[bag]  # the block's index in its sequence
    seq, head = bag // num_heads, bag % num_heads
    kt_row = (tables[seq, nth] * num_kv_heads + head // (num_heads // num_kv_heads)) * head_dim  # d = 0
    rows = (kt_row.unsqueeze(1) + torch.arange(head_dim, device=device)).reshape(-1)
    offsets = torch.arange(bag.numel(), device=device) * head_dim
    position = nth.unsqueeze(1) * block_size + torch.arange(block_size, device=device)  # [M, block_size]
    past_end = position >= lens[seq].unsqueeze(1)
    keep = (~past_end).reshape(-1).nonzero().squeeze(1)
    return BlockBags(rows, offsets, bag, per_bag, past_end, keep)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex,
                 scale: float) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, the order of the index's sequences) -> [B, H, D]; caches of logical
    shape [num_blocks, block_size, kv_heads, D], V contiguous, K transposed (the index built with head_dim then)
    or, float32 only, contiguous."""
    batch, num_heads, head_dim = q.shape
    if index.blocks is not None:
        weights, total = _softmax_numerators_kt(q, k_cache, index.blocks, scale)
    else:
        weights = _softmax_numerators(q, k_cache, index, scale)
        total = torch.segment_reduce(weights, "sum", lengths=index.lengths)
    out = F.embedding_bag(index.rows, v_cache.view(-1, head_dim), index.offsets, mode="sum",
                          per_sample_weights=weights.to(v_cache.dtype))
    out = out.float().div_(total.unsqueeze(1))  # normalised per bag: B * H divisions
    return out.to(q.dtype).view(batch, num_heads, head_dim)


def _softmax_numerators(q, k_cache, index: DecodeIndex, scale: float) -> torch.Tensor:
    """exp(score - max of its bag) per entry, K in the usual layout: one dot product per (position, head)."""
    head_dim = q.shape[2]
    scores = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        (q * scale).reshape(-1, head_dim), k_cache.view(-1, head_dim), index.rows, index.offsets, index.bag_of,
        0, -1)  # mode 0 = sum, padding_idx -1 = none: scores[e] = <q[bag_of[e]] * scale, k_row[rows[e]]>
    top = torch.segment_reduce(scores, "max", lengths=index.lengths)
    return scores.sub_(top.index_select(0, index.bag_of)).exp_()


def _softmax_numerators_kt(q, k_cache, bags: BlockBags, scale: float) -> torch.Tensor:
    """The same from a transposed K (a block's block_size scores per weighted row sum over head_dim rows), and
    each bag's sum of them; float32."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    k_rows = k_cache.permute(0, 2, 3, 1).view(-1, block_size)  # the memory: [num_blocks * kv_heads * D, bs]
    q_weights = (q.float() * scale).to(k_cache.dtype).reshape(-1, head_dim).index_select(0, bags.bag).view(-1)
    scores = F.embedding_bag(bags.rows, k_rows, bags.offsets, mode="sum", per_sample_weights=q_weights).float()
    scores.masked_fill_(bags.past_end, float("-inf"))  # [M, block_size]
    top = torch.segment_reduce(scores.amax(1), "max", lengths=bags.per_bag)  # [B * H]
    scores.sub_(top.index_select(0, bags.bag).unsqueeze(1)).exp_()  # past the end: exp(-inf) = 0
    total = torch.segment_reduce(scores.sum(1), "sum", lengths=bags.per_bag)
    return scores.view(-1).index_select(0, bags.keep), total
