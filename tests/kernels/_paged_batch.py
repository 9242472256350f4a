"""Random paged batches for the attention kernel tests: caches, scattered block tables, metadata."""

from __future__ import annotations

import torch

from shardserve.kernels.backends import AttentionMetadata


def make_batch(query_lens: list[int], seq_lens: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Returns (q, k, v, k_cache, v_cache, meta). The caches hold random prefixes; each sequence's blocks are
    scattered (a random permutation), so a kernel that ignores the block table reads the wrong keys."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks that nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    slots = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        tables[i, : blocks_per_seq[i]] = order[used : used + blocks_per_seq[i]].to(torch.int32)
        used += blocks_per_seq[i]
        for p in range(s_len - q_len, s_len):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    tokens = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q, k, v = rand(tokens, num_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads, head_dim)
    k_cache, v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim), rand(num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return q, k, v, k_cache, v_cache, meta


def every_e4m3_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """All 65,536 int16 values (two e4m3 each, low byte first) and which of them hold no NaN byte."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return x, ((x.view(torch.uint8).view(-1, 2) & 0x7F) != 0x7F).all(dim=1)
