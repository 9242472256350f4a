"""Whether a layer runs our fused Triton kernels (add+RMSNorm, q/k-norm+RoPE+KV store, SiLU-and-mul) on a tensor.

On CUDA they replace chains of small torch ops: a decode step of Llama-3-8B is otherwise ~1,500 kernel launches,
most of them a few microseconds of elementwise work, which costs milliseconds even inside a CUDA graph.
Elsewhere (CPU) the layers keep their torch code.
"""

from __future__ import annotations

import torch

from shardserve.worker import distributed

# A one-row step (bs=1 decode) at TP=1 runs each decoder layer as four GEMVs with the norms, SiLU-and-mul and
# residual adds inside them (kernels/gemv.py: gemv_fused; decoder.py). False only where a test compares it with the
# layer-by-layer path.
ONE_ROW = True
_HALF = (torch.bfloat16, torch.float16)


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda


def one_row(x: torch.Tensor) -> bool:
    """Whether the decoder's one-row path takes x [T, hidden]: a single token in half precision on CUDA, one rank
    (the residual add inside the row-parallel matmul would count it once per rank before the all-reduce)."""
    return (x.shape[0] == 1 and ONE_ROW and use_fused(x) and x.dtype in _HALF
            and distributed.tp_size() == 1)
