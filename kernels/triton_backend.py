"""The attention backend on our Triton kernels: store the new K/V, then one attention launch per step.

Decode-only batches (every query_len 1, the steady state) go to the split-K decode kernel; anything with a
prefill or chunk in it goes to the varlen prefill kernel, which handles its decodes in the same launch.
"""

from __future__ import annotations

import torch

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata
from shardserve.kernels.paged_decode import choose_num_splits, paged_decode_attention
from shardserve.kernels.prefill import paged_prefill_attention
from shardserve.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    store_kv = staticmethod(store_kv)

    def __init__(self, decode_num_splits: int | None = None) -> None:
        # None: pick splits per step from batch size and max_seq_len. A CUDA graph bakes in whatever its
        # capture step chose; any fixed value stays correct at replay (split ranges are computed on device).
        self.decode_num_splits = decode_num_splits

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            splits = self.decode_num_splits
            if splits is None:
                splits = choose_num_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len)
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                                          k_scale=k_scale, v_scale=v_scale)
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            k_scale=k_scale, v_scale=v_scale,
        )
