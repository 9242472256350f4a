"""Compiling the GPU sampler's kernel variants at start-up, instead of in the first step that meets each one."""

from __future__ import annotations

import torch

from shardserve.proto.plan import SamplingSpec
from shardserve.worker.sampler import sample_tokens
from shardserve.worker.sampling_row import SamplingRow

# One spec per compiled variant of the GPU sampler's kernels (kernels/sampling.py, sampling_filter.py): no filter,
# the cut-off search with and without its count search, top-k and min-p by masks; penalties on a float32 copy.
_WARM_SPECS = (SamplingSpec(temperature=1.0), SamplingSpec(temperature=1.0, top_p=0.9),
               SamplingSpec(temperature=1.0, top_k=50, top_p=0.9), SamplingSpec(temperature=1.0, top_k=50),
               SamplingSpec(temperature=1.0, min_p=0.1), SamplingSpec(temperature=1.0, repetition_penalty=1.1))


@torch.inference_mode()
def warm_up(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the GPU sampler's kernel variants at start-up, not in the first step that meets each one (without a
    Triton cache on disk that step took markedly longer). Nothing to do on CPU, which compiles nothing."""
    if device.type != "cuda":
        return
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    for spec in _WARM_SPECS:
        sample_tokens(logits, [SamplingRow(spec, [0, 1], 1)] * 2)
    torch.cuda.synchronize(device)
