"""The attention layer: reshapes flat q/k/v into heads and hands them, with this layer's paged cache, to the backend."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        out = self.backend.forward(
            q.reshape(tokens, self.num_heads, self.head_dim),
            k.reshape(tokens, self.num_kv_heads, self.head_dim),
            v.reshape(tokens, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            meta,
            self.scale,
        )
        return out.reshape(tokens, self.num_heads * self.head_dim)
