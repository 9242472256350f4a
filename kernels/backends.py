"""The attention-backend interface: what a model layer hands to attention (which backend: backend_choice.py).

A step's batch is a flat list of T tokens from B sequences. Sequence i contributes query_lens[i] new tokens
at positions [seq_lens[i] - query_lens[i], seq_lens[i]); its keys and values for all seq_lens[i] positions
live in the paged cache once this step has stored the new ones. A decode is a sequence with query_len 1;
a prefill (whole, a chunk, or the rest after a prefix-cache hit) has query_len >= 1 and sees the paged prefix.

Cache layout per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim] (the view; the
torch backend on the CPU keeps K's memory as [num_blocks, num_kv_heads, head_dim, block_size] under it);
token position p of a sequence lives in block block_tables[i][p // block_size] at offset p % block_size,
i.e. slot = block * block_size + offset in the flattened [num_blocks * block_size] view. Slot -1 is skipped.
An FP8 cache (float8 e4m3, kv_fp8.py) comes with k_scale and v_scale, [num_kv_heads] float32 each: store_kv
quantizes with them, attend dequantizes with them; a cache in the model's dtype has none.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 = do not store
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]  # the same facts on the host, for backends that loop or size launches
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    _derived: dict = field(default_factory=dict, repr=False)  # computed once a step for every layer

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def _once(self, key, compute):
        """compute() the first time a step asks for key; every later layer gets the same value."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def leading_decodes(self) -> int:
        """How many sequences at the front of the batch are decodes (the scheduler puts running requests first)."""
        return self._once("decodes", lambda: next((i for i, q_len in enumerate(self.query_lens_cpu) if q_len != 1),
                                                  len(self.query_lens_cpu)))

    def tail(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens, block_tables) of sequences first.. as a batch of their own, the tokens counted
        from 0 (the sequences before `first` being decodes: first tokens). Fresh tensors, not views: a view's
        address moves by 4 bytes a sequence, and Triton compiles a kernel anew for each 16-byte alignment of its
        pointers (a compile of seconds in the middle of a run)."""
        return self._once(("tail", first), lambda: (self.query_start_loc[first:] - first,
                                                    self.seq_lens[first:].clone(), self.block_tables[first:].clone()))

    def longest_first(self, num_seqs: int) -> torch.Tensor:
        """longest_first over the first num_seqs sequences, sorted once a step for every layer (inside a decode
        graph the sort is captured with the layers)."""
        def order() -> torch.Tensor:
            from shardserve.kernels.decode_order import longest_first  # Triton, optional: only where it runs

            return longest_first(self.seq_lens[:num_seqs])

        return self._once(("order", num_seqs), order)


class AttentionBackend:
    """Stores the new K/V into the paged cache, then attends each query to its sequence's cached context.

    A backend supplies the two halves: store_kv (slot -1 skipped) and attend (over the cache, new K/V included)."""

    name = "base"

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32: an FP8 cache's scales
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def new_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's zero-filled (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] (a
        backend may lay K's memory out otherwise under that view: the torch backend on the CPU does)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cache_zeros(shape, dtype, device), cache_zeros(shape, dtype, device)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros for a KV cache. On the CPU over an anonymous memory map instead: its pages read as zeros and take
    memory only once written, so the cache costs start-up nothing and a process's memory grows as its cache fills.
    torch.zeros writes every page at once, seconds of CPU a GiB when several TP ranks on one host do it together."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    size = count * dtype.itemsize
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # kept alive by the tensor
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
