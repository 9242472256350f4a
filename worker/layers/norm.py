"""RMSNorm (as HF Llama/Qwen: normalise in float32, scale in the model dtype), with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels import cpu_native
from shardserve.worker.layers import _fused
from shardserve.worker.layers._sharding import attach_loader, default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        attach_loader(self.weight, default_weight_loader, {None: (hidden_size,)})
        # True where the output feeds only FP8 linear layers (quantization="fp8"): on CUDA the kernel then hands
        # them its rows quantized (kernels/fp8_linear.py: Fp8Rows), one launch instead of two
        self.fp8_out = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch.rms_norm without a weight is HF's (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype) in one op (bit
        # for bit in float32 and bfloat16, and faster on the CPU); the weight is then applied in the model's dtype,
        # as HF does
        return self.weight * torch.rms_norm(x, (x.shape[-1],), None, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s), the new residual."""
        if _fused.use_fused(x):
            from shardserve.kernels.rmsnorm import add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, self.fp8_out)
            return add_rms_norm(x, residual, self.weight, self.eps, self.fp8_out)
        normed = cpu_native.rms_norm(x, self.weight, self.eps, residual)  # on the CPU: the same bits in one C pass
        if normed is not None:
            return normed
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed
