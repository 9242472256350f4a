"""Programmatic dependent launch (PDL) on Hopper and later: a kernel launched as a programmatic dependent of the
kernel before it on the stream may start once every program of that kernel has signalled
(`gdc_launch_dependents`), and waits (`gdc_wait`) for that kernel to finish, its writes visible, before it reads
what that kernel wrote. The launch and the programs' start overlap the previous kernel's tail: at bs=1 a decoder
layer is a chain of short kernels, each of which otherwise waits for the last to end before it is even launched.

The one-pass GEMV takes it (kernels/gemv.py), and so do RoPE with its cache write, decode attention and the split
merge, RMSNorm (with its residual add) and SiLU-and-mul: each signals its dependents and waits at its very start,
before any load, so it computes exactly what a plain launch computes, and a bs=1 decode step is shorter.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

CHAIN = True  # False only where a test compares the chain with plain launches


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def supported(t: torch.Tensor) -> bool:
    """Whether kernels working on t may be launched as programmatic dependents (CUDA, compute capability >= 9)."""
    return t.is_cuda and _capable(t.device)


def chained(t: torch.Tensor) -> bool:
    """Whether the RoPE, decode attention, merge, RMSNorm and SiLU-and-mul kernels working on t launch as
    programmatic dependents."""
    return CHAIN and supported(t)


@triton.jit
def start_as_dependent():
    """A chained kernel's first statement: let the next kernel launch, then wait for the one before to finish."""
    gdc_launch_dependents()
    gdc_wait()
