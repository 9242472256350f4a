"""SiLU-and-mul: the gated activation of Llama/Qwen MLPs over the merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] (gate, then up) -> silu(gate) * up, [..., d]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
