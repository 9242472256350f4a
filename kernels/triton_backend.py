"""The attention backend on our Triton kernels: store the new K/V, then one attention launch per step.

Decode-only batches (every query_len 1, the steady state) go to the split-K decode kernel; anything with a
prefill or chunk in it goes to the varlen prefill kernel, which handles its decodes in the same launch.
SHARDSERVE_SPLIT_MIXED=N (opt-in; 0, the default: never): a mixed batch that starts with at least N decodes sends
those to the decode kernel and the rest to the prefill kernel, two launches: the prefill kernel reads decode rows at
74-84% of the copy rate with a bf16 cache and 30-39% with FP8, the decode kernel at 83-107%. On an H200, timed warm,
63 or 255 decodes beside a 512-token prefill ran 1.12-1.20x (bf16) and 1.42-1.80x (FP8) faster split; but with the
split on from 32 decodes an offline Qwen3-0.6B run spent 2.43 s instead of 0.46 s in its prefill steps
(docs/performance-history.md). The likely cause: the prefill kernel was handed seq_lens[decodes:], a view whose address is
16-byte aligned only when decodes is a multiple of 4, and Triton compiles a new variant for an unaligned pointer
(1.8-3.2 s for sm_90 on a 2-core machine, about the time lost). With the tails fresh tensors
(AttentionMetadata.tail) the offline run lost no time to compiles, but gained nothing either (bf16 24,949 against
24,664 out tok/s, FP8 31,396 against 32,951): the split stays off by default.
"""

from __future__ import annotations

import os

import torch

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata
from shardserve.kernels.paged_decode import choose_num_splits, paged_decode_attention
from shardserve.kernels.prefill import paged_prefill_attention
from shardserve.kernels.store_kv import store_kv


SPLIT_MIXED = int(os.environ.get("SHARDSERVE_SPLIT_MIXED", "0"))  # the default of split_mixed; 0: off
# The order the decode kernel starts its programs in (SHARDSERVE_DECODE_ORDER): "longest" (the default) the
# longest contexts first, "batch" the batch's order (AttentionMetadata.longest_first: one argsort a step, shared by
# every layer). On an H200, kernel alone, batches of 128-256 unequal contexts (100-1,024 or
# 100-2,048 tokens) read 7-20% faster longest first, 32-64 sequences over 100-4,096 faster or slower by case; the
# offline Qwen3-0.6B run spent 2-3% less in its decode steps (docs/performance-history.md).
DECODE_ORDER = os.environ.get("SHARDSERVE_DECODE_ORDER", "longest")
if DECODE_ORDER not in ("batch", "longest"):
    raise ValueError(f"SHARDSERVE_DECODE_ORDER: expected longest or batch, got {DECODE_ORDER!r}")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    store_kv = staticmethod(store_kv)

    def __init__(self, decode_num_splits: int | None = None, split_mixed: int | None = None) -> None:
        # None: pick splits per step from batch size and max_seq_len. A CUDA graph bakes in whatever its
        # capture step chose; any fixed value stays correct at replay (split ranges are computed on device).
        self.decode_num_splits = decode_num_splits
        self.split_mixed = SPLIT_MIXED if split_mixed is None else split_mixed  # see the module's docstring

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
        order = meta.longest_first(num_seqs) if DECODE_ORDER == "longest" and num_seqs > 1 else None
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, splits, out=out, k_scale=k_scale,
                                      v_scale=v_scale, order=order)
