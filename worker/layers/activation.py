"""SiLU-and-mul: the gated activation of Llama/Qwen MLPs over the merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.worker.layers import _fused


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] (gate, then up) -> silu(gate) * up, [..., d]."""
        if _fused.use_fused(gate_up):
            from shardserve.kernels.silu_and_mul import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
