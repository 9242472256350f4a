"""Rotary position embedding, neox style (rotate-half), as HF Llama/Qwen; with llama3 frequency scaling.

cos/sin are precomputed for every position up to max_position_embeddings and indexed by the step's
positions, so a forward does no trigonometry (and the lookup is CUDA-graph friendly).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardserve.kernels import cpu_native

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from a config of transformers 4.x (rope_theta/rope_scaling) or 5.x (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    params["rope_type"] = rope_type
    return float(theta), params


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by factor, short ones kept, a smooth blend in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling and scaling.get("rope_type") == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        # float32 always: the caller's dtype is applied at use (HF also keeps cos/sin in float32 until the end)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        # On CPU the step's (positions, cos, sin): every layer gets the same positions tensor, so the lookup runs once
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, heads, head_dim], k [T, kv_heads, head_dim] -> rotated q, k (same dtype)."""
        cos, sin = self._cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates x [T, heads, head_dim] in place (a view of the qkv output: q and k heads side by side), with
        the values forward() gives: on the CPU by the C kernel (kernels/cpu_native.py, the same bits in one pass),
        else by torch ops."""
        if cpu_native.rope_(x, positions, self.cos_cache, self.sin_cache):
            return
        first, second = _rotated_halves(x, *self._cos_sin(positions))
        x[..., : self.head_dim // 2].copy_(first)
        x[..., self.head_dim // 2 :].copy_(second)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2] of the positions; on CPU looked up once per step (per positions tensor;
        not on CUDA, where a graph replays the lookup that it captured)."""
        if self._step is not None and self._step[0] is positions:
            return self._step[1], self._step[2]
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        if positions.device.type == "cpu":
            self._step = (positions, cos, sin)
        return cos, sin


def _rotated_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), per half, in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (views of x itself where x is float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.cat(_rotated_halves(x, cos, sin), dim=-1).to(x.dtype)
