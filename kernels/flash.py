"""The attention backend over flash-attn (`pip install shardserve[flash-attn]`), where it is installed.

Untested here: flash-attn has no wheel and is not installed on our development or GPU machines; importing
this module raises ImportError without it, and get_backend("auto") then falls back to our Triton kernels.
Written against flash-attn 2.x's flash_attn_varlen_func(..., block_table=...), which reads K/V straight from
the paged cache [num_blocks, block_size, num_kv_heads, head_dim] and aligns the causal mask bottom-right
(query j of a q_len-token chunk sees keys 0 .. seq_len - q_len + j), the semantics of AttentionMetadata.
flash-attn 2 requires the cache block size to be a multiple of 256 for a paged cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func  # ImportError where flash-attn is absent, by design

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata
from shardserve.kernels.store_kv import store_kv


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    store_kv = staticmethod(store_kv)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if k_scale is not None:
            raise ValueError("the flash-attn backend has no FP8 KV cache here: use --attention-backend triton")
        block_size = k_cache.shape[1]
        if block_size % 256:
            raise ValueError(f"flash-attn's paged attention needs a block size that is a multiple of 256, got {block_size}")
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
