"""Kernel tests run Triton in interpreter mode on CPU (no GPU here). The variable must be set before any
@triton.jit decorator runs, i.e. before the kernel modules are imported; conftest files load first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
