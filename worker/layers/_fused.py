"""Whether a layer runs our fused Triton kernels (add+RMSNorm, q/k-norm+RoPE, SiLU-and-mul) on a tensor.

On CUDA they replace chains of small torch ops: a decode step of Llama-3-8B is otherwise ~1,500 kernel launches,
most of them a few microseconds of elementwise work, which costs milliseconds even inside a CUDA graph.
Elsewhere (CPU) the layers keep their torch code. SHARDSERVE_FUSED_KERNELS=0 turns the kernels off (A/B runs).
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("SHARDSERVE_FUSED_KERNELS", "1") != "0"


def use_fused(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda
