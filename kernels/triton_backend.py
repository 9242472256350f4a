"""The attention backend on our Triton kernels: store the new K/V, then one attention launch per step.

Decode-only batches (every query_len 1, the steady state) go to the split-K decode kernel; anything with a
prefill or chunk in it goes to the varlen prefill kernel, which handles its decodes in the same launch.
With the setting split_mixed_decodes = N (opt-in; 0, the default: never), a mixed batch that starts with at
least N decodes sends those to the decode kernel and the rest to the prefill kernel, two launches: the prefill
kernel reads decode rows well below the copy rate (an FP8 cache's the furthest below), the decode kernel near it.
Timed warm on mixed batches the split is faster; in offline runs, whose mixed steps are few, it gained nothing, so it
is off by default (docs/performance-history.md). The tails handed to the prefill kernel are fresh tensors
(AttentionMetadata.tail): a view at an unaligned address would make Triton compile a new kernel variant mid-run.

The decode kernel starts its programs longest context first (AttentionMetadata.longest_first: one argsort a step,
shared by every layer), so the longest sequences' programs are not the launch's tail.
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

    def __init__(self, decode_num_splits: int | None = None, split_mixed: int = 0) -> None:
        # None: pick splits per step from batch size and max_seq_len. A CUDA graph bakes in whatever its
        # capture step chose; any fixed value stays correct at replay (split ranges are computed on device).
        self.decode_num_splits = decode_num_splits
        self.split_mixed = split_mixed  # EngineConfig.split_mixed_decodes: see the module's docstring

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return self._decode(q, k_cache, v_cache, meta, meta.num_seqs, scale, k_scale, v_scale)
        decodes = meta.leading_decodes() if self.split_mixed else 0
        if decodes < max(self.split_mixed, 1):
            return paged_prefill_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                k_scale=k_scale, v_scale=v_scale,
            )
        out = torch.empty_like(q)
        self._decode(q[:decodes], k_cache, v_cache, meta, decodes, scale, k_scale, v_scale, out=out[:decodes])
        query_start_loc, seq_lens, block_tables = meta.tail(decodes)
        paged_prefill_attention(q[decodes:], k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                out=out[decodes:], k_scale=k_scale, v_scale=v_scale)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                num_seqs: int, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode kernel over the batch's first num_seqs sequences (one query token each)."""
        splits = self.decode_num_splits
        if splits is None:
            splits = choose_num_splits(num_seqs, k_cache.shape[2], meta.max_seq_len)
        tables, seq_lens = meta.block_tables, meta.seq_lens
        if num_seqs < meta.num_seqs:
            tables, seq_lens = tables[:num_seqs], seq_lens[:num_seqs]
        order = meta.longest_first(num_seqs) if num_seqs > 1 else None
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, splits, out=out, k_scale=k_scale,
                                      v_scale=v_scale, order=order)
