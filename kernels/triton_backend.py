"""The attention backend on our Triton kernels: store the new K/V, then one attention launch per step.

Decode-only batches (every query_len 1, the steady state) go to the split-K decode kernel; anything with a
prefill or chunk in it goes to the varlen prefill kernel, which handles its decodes in the same launch.
SHARDSERVE_SPLIT_MIXED=N (opt-in; 0, the default: never): a mixed batch that starts with at least N decodes sends
those to the decode kernel and the rest to the prefill kernel, two launches: the prefill kernel reads decode rows at
74-84% of the copy rate with a bf16 cache and 30-39% with FP8, the decode kernel at 83-107%. On an H200, timed warm,
63 or 255 decodes beside a 512-token prefill ran 1.12-1.20x (bf16) and 1.42-1.80x (FP8) faster split; but with the
split on from 32 decodes an offline Qwen3-0.6B run spent 2.43 s instead of 0.46 s in its prefill steps
(docs/performance.md). The likely cause: the prefill kernel was handed seq_lens[decodes:], a view whose address is
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
# offline Qwen3-0.6B run spent 2-3% less in its decode steps (docs/performance.md).
DECODE_ORDER = os.environ.get("SHARDSERVE_DECODE_ORDER", "longest")
if DECODE_ORDER not in ("batch", "longest"):
    raise ValueError(f"SHARDSERVE_DECODE_ORDER: expected longest or batch, got {DECODE_ORDER!r}")


# Prompts with nothing cached before this step (whole, or a first chunk) attend to the step's own k and v through
# torch's flash attention (varlen, causal) where it runs (SHARDSERVE_PREFILL_FLASH): "1" (default) with a cache in
# the model's dtype, "all" with an FP8 cache too (the prompt then attends to its keys before quantization, not to
# the cache's e4m3 copy), "0" never. Sequences before them (decodes, chunks after a prefix) take the prefill kernel.
PREFILL_FLASH = os.environ.get("SHARDSERVE_PREFILL_FLASH", "1")
if PREFILL_FLASH not in ("0", "1", "all"):
    raise ValueError(f"SHARDSERVE_PREFILL_FLASH: expected 0, 1 or all, got {PREFILL_FLASH!r}")


def flash_ready(q: torch.Tensor) -> bool:
    """Whether torch's flash attention takes these queries: CUDA, 16-bit, a head size it has, sm_80+."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of each sequence's queries to its own keys (packed [T, heads, D], cu_seqlens [B + 1]
    int32), GQA as the kernel takes it: torch's flash-attention op (the public varlen_attn's signature differs
    between torch releases; the op's has not)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
                                                   False, scale=scale)[0]


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

    def reads_new_kv(self, q: torch.Tensor, meta: AttentionMetadata, fp8_cache: bool) -> bool:
        """A batch that is not decodes alone and ends in prompts with nothing cached, where flash attention runs
        (PREFILL_FLASH)."""
        return (PREFILL_FLASH != "0" and (PREFILL_FLASH == "all" or not fp8_cache) and not meta.is_decode_only
                and meta.fresh_from() < meta.num_seqs and flash_ready(q))

    def attend_stored(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not self.reads_new_kv(q, meta, k_scale is not None):
            return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        first = meta.fresh_from()
        head = sum(meta.query_lens_cpu[:first])  # the tokens of the sequences before the fresh ones
        max_len = max(meta.query_lens_cpu[first:])
        cu_seqlens = meta.query_start_loc if first == 0 else meta.query_start_loc[first:] - head
        fresh = flash_causal(q[head:], k[head:], v[head:], cu_seqlens, max_len, scale)
        if first == 0:
            return fresh
        out = torch.empty_like(q)
        out[head:] = fresh
        paged_prefill_attention(q[:head], k_cache, v_cache, meta.query_start_loc[: first + 1], meta.seq_lens[:first],
                                meta.block_tables[:first], scale, out=out[:head], k_scale=k_scale, v_scale=v_scale)
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
