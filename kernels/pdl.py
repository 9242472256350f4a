"""Programmatic dependent launch (PDL) on Hopper and later: a kernel launched as a programmatic dependent of the
kernel before it on the stream may start once every program of that kernel has signalled
(`gdc_launch_dependents`), and waits (`gdc_wait`) for that kernel to finish, its writes visible, before it reads
what that kernel wrote. The launch and the programs' start overlap the previous kernel's tail: at bs=1 a decoder
layer is a chain of short kernels, each of which otherwise waits for the last to end before it is even launched.

The one-pass GEMV takes it by default (kernels/gemv.py: PDL), and so do RoPE with its cache write, decode
attention and the split merge (SHARDSERVE_PDL_CHAIN=0 turns those three off): each signals its dependents and waits
at its very start, before any load, so it computes exactly what a plain launch computes. On an H200 the chain took
bs=1 Llama-3-8B from 4.10 to 4.07 ms a token and Qwen3-0.6B from 0.867 to 0.828 (docs/performance.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

CHAIN = os.environ.get("SHARDSERVE_PDL_CHAIN", "1") != "0"


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def supported(t: torch.Tensor) -> bool:
    """Whether kernels working on t may be launched as programmatic dependents (CUDA, compute capability >= 9)."""
    return t.is_cuda and _capable(t.device)


def chained(t: torch.Tensor) -> bool:
    """Whether the RoPE, decode attention and merge kernels working on t launch as programmatic dependents."""
    return CHAIN and supported(t)


@triton.jit
def start_as_dependent():
    """A chained kernel's first statement: let the next kernel launch, then wait for the one before to finish."""
    gdc_launch_dependents()
    gdc_wait()
