"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks (no communication); row-parallel layers
split the input features and all-reduce the partial sums. An MLP or attention block is column -> row,
so it costs one all-reduce. Weights are [out_features, in_features] as in nn.Linear / HF checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels.cpu_native import AmxWeight
from shardserve.kernels.kv_fp8 import FP8_DTYPE
from shardserve.worker.distributed import all_reduce, tp_rank, tp_size
from shardserve.worker.layers import cpu_packed
from shardserve.worker.layers._sharding import attach_loader, copy_into, narrow_loaded


# Decode at batch 1 on CUDA: the Triton GEMV (kernels/gemv.py) instead of cuBLAS, which reads narrow weights at
# M = 1 below the copy rate. Not where K > GEMV_MAX_K (Llama-3-8B's down projection, K = 14,336, where cuBLAS was as
# fast), except for e4m3 weights (cuBLAS's FP8 product at M = 1 reads them no faster than bf16 weights).
GEMV_MAX_K = 8192


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, weight_amx: AmxWeight | None = None) -> torch.Tensor:
    """x W^T + b: the FP8 product for an e4m3 weight with its per-channel scales (kernels/fp8_linear.py), oneDNN on a
    packed CPU weight (layers/cpu_packed.py; weight_amx its AMX view for a few rows), the GEMV for one row of a
    half-precision x on CUDA, else F.linear."""
    if weight.dtype == FP8_DTYPE:
        from shardserve.kernels.fp8_linear import Fp8Rows, fp8_linear  # (Triton: imported where it is used)

        rows, x_scale = (x.q, x.scale) if isinstance(x, Fp8Rows) else (x, None)
        if _one_row(rows, x.dtype):  # e4m3 weights at one row: a pass over them, no tensor cores wanted (gemv.py)
            return _gemv(rows, weight, bias, weight_scale=weight_scale, x_scale=x_scale, out_dtype=x.dtype)
        return fp8_linear(x, weight, weight_scale, bias)
    if weight.is_mkldnn:
        return cpu_packed.linear(x, weight, bias, weight_amx)
    if (_one_row(x, x.dtype) and weight.shape[1] <= GEMV_MAX_K and weight.dtype == x.dtype
            and weight.stride(1) == 1):
        return _gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **scales) -> torch.Tensor:
    """The one-row Triton GEMV (kernels/gemv.py) with its tiles for a plain matmul, plus the bias."""
    from shardserve.kernels.gemv import gemv

    y = gemv(x, weight, block_n=8, block_k=1024, warps=4, **scales)
    return y if bias is None else y + bias


def _one_row(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """One row on CUDA of a model in half precision: what the Triton GEMV is for."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and dtype in (torch.bfloat16, torch.float16)


def quantize_module_weight(module: nn.Module) -> None:
    """module.weight [out, in] becomes float8 e4m3 with a float32 scale per output channel in module.weight_scale
    [1, out] (kernels/fp8_linear.py); matmul then takes the FP8 product. After loading, before any graph capture."""
    from shardserve.kernels.fp8_linear import quantize_weight

    weight, scale = quantize_weight(module.weight.data)
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.weight_scale = scale


def quantize_linear_weights(model: nn.Module) -> int:
    """Every column- and row-parallel layer's weight to FP8 (`quantization="fp8"`); the LM head and the embedding
    keep the model's dtype. Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        quantize_module_weight(layer)
    return len(layers)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by rows (output features): each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        attach_loader(self.weight, self.weight_loader, {None: (out_features, in_features)})
        self.register_buffer("weight_scale", None)  # [1, out] float32 once the weight is FP8 (quantize_module_weight)
        self.weight_amx = None  # CPUs with AMX: the packed bf16 weight as the AMX loop reads it (layers/cpu_packed.py)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            attach_loader(self.bias, self.weight_loader, {None: (out_features,)})

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        copy_into(param.data, narrow_loaded(loaded, 0, self.tp_rank * size, size), "column-parallel weight")

    def pack_weights(self) -> bool:
        """On CPU, after loading: the weight becomes oneDNN's packed copy (layers/cpu_packed.py)."""
        return cpu_packed.replace_with_packed(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias, self.weight_scale, self.weight_amx)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_proj + up_proj).

    shard_id i loads the i-th projection; each rank's weight is [its slice of proj 0; its slice of proj 1; ...].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, gated: bool = False) -> None:
        """gated: the MLP's [gate; up], whose SiLU-and-mul may run in the matmul's store (silu_and_mul)."""
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes_per_rank = [_divide(s, self.tp_size, "merged output features") for s in out_sizes]
        self.gated = gated and len(out_sizes) == 2 and out_sizes[0] == out_sizes[1] and not bias
        attach_loader(self.weight, self.weight_loader, {i: (s, in_features) for i, s in enumerate(out_sizes)})
        if self.bias is not None:
            attach_loader(self.bias, self.weight_loader, {i: (s,) for i, s in enumerate(out_sizes)})

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up straight from the matmul (CPU with AMX, a decode step's rows), or None: then
        SiluAndMul(forward(x))."""
        return cpu_packed.silu_and_mul(x, self.weight_amx) if self.gated else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"merged linear needs an integer shard_id, got {shard_id!r}")
        size = self.out_sizes_per_rank[shard_id]
        offset = sum(self.out_sizes_per_rank[:shard_id])
        src = narrow_loaded(loaded, 0, self.tp_rank * size, size)
        copy_into(param.data.narrow(0, offset, size), src, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with grouped-query attention, split by heads.

    Each rank holds num_heads / tp query heads and num_kv_heads / tp KV heads. When tp > num_kv_heads
    (tp a multiple of it) every rank holds one KV head, replicated: rank r uses KV head r // (tp / num_kv_heads),
    the one its query heads attend to.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        heads_per_rank = _divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) exceeds num_key_value_heads ({num_kv_heads}) "
                    "and must then be a multiple of it"
                )
            kv_heads_per_rank = 1
        else:
            kv_heads_per_rank = _divide(num_kv_heads, tp, "num_key_value_heads")
        super().__init__(hidden_size, (heads_per_rank + 2 * kv_heads_per_rank) * head_dim * tp, bias)
        self.num_heads_per_rank = heads_per_rank
        self.num_kv_heads_per_rank = kv_heads_per_rank
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        shapes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        attach_loader(self.weight, self.weight_loader, {s: (n, hidden_size) for s, n in shapes.items()})
        if self.bias is not None:
            attach_loader(self.bias, self.weight_loader, {s: (n,) for s, n in shapes.items()})

    @property
    def q_size(self) -> int:
        return self.num_heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads_per_rank * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            if self.tp_size >= self.num_kv_heads:  # replicated KV heads
                kv_head = self.tp_rank // (self.tp_size // self.num_kv_heads)
            else:
                kv_head = self.tp_rank * self.num_kv_heads_per_rank
            start = kv_head * self.head_dim
        else:
            raise ValueError(f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        src = narrow_loaded(loaded, 0, start, size)
        copy_into(param.data.narrow(0, offset, size), src, f"qkv shard {shard_id}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features); partial sums are all-reduced, then b added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        attach_loader(self.weight, self.weight_loader, {None: (out_features, in_features)})
        self.register_buffer("weight_scale", None)  # [1, out] float32 once the weight is FP8 (quantize_module_weight)
        self.weight_amx = None  # CPUs with AMX: the packed bf16 weight as the AMX loop reads it (layers/cpu_packed.py)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            attach_loader(self.bias, self.bias_loader, {None: (out_features,)})

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = self.in_per_rank
        copy_into(param.data, narrow_loaded(loaded, 1, self.tp_rank * size, size), "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        copy_into(param.data, narrow_loaded(loaded, 0, 0, param.shape[0]), "row-parallel bias")

    def pack_weights(self) -> bool:
        return cpu_packed.replace_with_packed(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(matmul(x, self.weight, None, self.weight_scale, self.weight_amx))
        return y + self.bias if self.bias is not None else y
