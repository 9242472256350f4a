"""CPU matmuls on weights reordered once into oneDNN's blocked layout ("prepacked"), as torch.compile's CPU
backend does for frozen linear weights.

F.linear on CPU hands the library a weight in its plain [out, in] layout, which it re-blocks for its kernels on
every call; the packed weight is blocked once, at load, which takes markedly less time a step, in decode steps
most (docs/performance-history.md).

Packing is the last step of loading (`pack_model`): a linear layer's weight Parameter is replaced by a buffer of
the same name and shape holding the packed tensor (layout torch._mkldnn), so the weights are not kept twice; the
LM head keeps its plain weight (the tied embedding reads it) and gets a packed copy beside it. Where oneDNN or the
dtype is not usable (no mkldnn build, float16 without hardware support), the probe in `pack` fails and the model
keeps F.linear. The results differ from F.linear's in the last bits (another summation order), as any two BLAS
libraries' do.

On a CPU with AMX, the matmuls of up to AMX_MAX_ROWS rows (decode steps) of a bfloat16 weight run on AMX tiles
(`kernels/cpu_amx.c`), reading the weight oneDNN packed in place (its blocked layout is the tiles' own; checked per
weight at load, `cpu_native.amx_weight`, so the weights are held once): at decode batches the loop reads them
faster than oneDNN's matmul; beyond ~128 rows oneDNN is faster, so prefill keeps it. The MLP's gate_up matmul does
SiLU-and-mul in its store there (`silu_and_mul`).
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels import cpu_native

# Packing and the AMX loop are always on where the CPU can run them; False only where a test compares a path with
# the plain one (F.linear; oneDNN for every row count).
ENABLED = True
AMX = True
_PACK_HINT_ROWS = 32  # the batch size oneDNN tunes the layout for; the same speed at 32 and 2,048 rows
# The most rows the AMX loop takes: faster than oneDNN up to here, not at 128 (docs/performance-history.md)
AMX_MAX_ROWS = 96


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a [out, in] CPU weight, or None where oneDNN cannot run it (checked on a probe)."""
    if not (ENABLED and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_floating_point()
            and weight.element_size() >= 2 and torch.backends.mkldnn.is_available()):  # (not an FP8 weight)
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        if not torch.allclose(linear(probe, packed).float(), (probe @ weight.t()).float(), rtol=1e-2, atol=1e-2):
            return None
    except (RuntimeError, AttributeError):  # no such op in this build, or no kernel for this dtype here
        return None
    return packed


def amx_weight(packed: torch.Tensor, weight: torch.Tensor) -> cpu_native.AmxWeight | None:
    """The AMX loop's view of packed (pack's copy of a bfloat16 weight), or None (another dtype, no AMX, switched
    off, oneDNN's layout not the one the loop reads)."""
    return cpu_native.amx_weight(packed, weight) if AMX and ENABLED else None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           amx: cpu_native.AmxWeight | None = None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out]; with amx (amx_weight's view), up to AMX_MAX_ROWS rows on
    AMX."""
    out = _on_amx(x, lambda rows: cpu_native.linear_amx(rows, amx)) if amx is not None else None
    if out is not None:
        return out if bias is None else out.add_(bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _on_amx(x: torch.Tensor, matmul) -> torch.Tensor | None:
    """matmul(rows) over x [..., in]'s rows, shaped back, where they are few enough for AMX; None above
    AMX_MAX_ROWS (or where matmul gives None)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > AMX_MAX_ROWS:
        return None
    out = matmul(rows.contiguous())
    return None if out is None else out.reshape(*x.shape[:-1], out.shape[-1])


def replace_with_packed(module: nn.Module) -> bool:
    """Swaps module.weight (a Parameter) for its packed buffer and sets module.weight_amx (amx_weight's view of it,
    or None); False (nothing changed) where it cannot be packed."""
    packed = pack(module.weight)
    if packed is None:
        return False
    module.weight_amx = amx_weight(packed, module.weight)
    del module.weight
    module.register_buffer("weight", packed, persistent=False)
    return True


def silu_and_mul(x: torch.Tensor, amx: cpu_native.AmxWeight | None) -> torch.Tensor | None:
    """silu(gate) * up from the matmul itself for up to AMX_MAX_ROWS rows of x [..., in], amx the view of a gate_up
    weight [gate; up]; None (more rows, no view, or a gate not in whole 32-column blocks)."""
    if amx is None:
        return None
    return _on_amx(x, lambda rows: cpu_native.linear_amx_silu_and_mul(rows, amx))


def pack_model(model: nn.Module) -> int:
    """Packs every module that has a `pack_weights()` (the linear layers, the LM head); returns how many did."""
    return sum(bool(module.pack_weights()) for module in model.modules() if hasattr(module, "pack_weights"))
