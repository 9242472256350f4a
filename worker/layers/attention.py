"""The attention layer: reshapes flat q/k/v into heads and hands them, with this layer's paged cache, to the backend.

With an FP8 cache the layer owns its scales (k_scale, v_scale: one float32 per KV head of this rank), set once at
start-up from the checkpoint or by calibration (worker/kv_scales.py), then fixed: the decode CUDA graphs read them
where they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:  # the Triton kernels are imported only where a CUDA layer asks for them
    from shardserve.kernels.store_kv import KVWrite


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
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32), persistent=False)
        self.scales_from_checkpoint = False
        # Calibration (worker/kv_scales.py): while set, [2, num_kv_heads] running max |k|, |v| of what is stored.
        self.observed_amax: torch.Tensor | None = None

    def kv_write(self, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> KVWrite | None:
        """Where a kernel producing K may store K and v itself (kernels/rope.py), when this backend stores with the
        Triton store_kv and no calibration watches what is stored; None: forward stores them."""
        from shardserve.kernels.store_kv import KVWrite, store_kv

        if self.backend.store_kv is not store_kv or self.observed_amax is not None:
            return None
        k_cache, v_cache = kv_cache
        scaled = k_cache.element_size() == 1  # an FP8 cache
        return KVWrite(v.reshape(v.shape[0], self.num_kv_heads, self.head_dim), k_cache, v_cache, meta.slot_mapping,
                       self.k_scale if scaled else None, self.v_scale if scaled else None)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        stored: bool = False,  # k and v are in the cache already (written through kv_write)
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        scaled = k_cache.element_size() == 1  # an FP8 cache
        k_scale, v_scale = (self.k_scale, self.v_scale) if scaled else (None, None)
        if stored:
            out = self.backend.attend(q.reshape(tokens, self.num_heads, self.head_dim), k_cache, v_cache, meta,
                                      self.scale, k_scale, v_scale)
            return out.reshape(tokens, self.num_heads * self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.observed_amax is not None and tokens:
            seen = torch.stack([k.detach().abs().amax(dim=(0, 2)), v.detach().abs().amax(dim=(0, 2))]).float()
            torch.maximum(self.observed_amax, seen, out=self.observed_amax)
        out = self.backend.forward(
            q.reshape(tokens, self.num_heads, self.head_dim),
            k,
            v,
            k_cache,
            v_cache,
            meta,
            self.scale,
            k_scale,
            v_scale,
        )
        return out.reshape(tokens, self.num_heads * self.head_dim)
