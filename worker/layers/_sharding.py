"""Helpers for weight loaders: read one rank's slice of a tensor or of a lazy safetensors slice.

A weight loader receives either a torch.Tensor (dummy weights, tests) or a safetensors `PySafeSlice`
(opened with framework="pt"); indexing the latter reads only the selected bytes from disk.
"""

from __future__ import annotations

from typing import Any

import torch


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_loaded(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length, ...] along dim, materialised as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def read_full(loaded: Any) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:]


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: shape mismatch, parameter slice {tuple(dst.shape)} vs checkpoint slice {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype))


def attach_loader(param: torch.nn.Parameter, loader: Any, global_shards: dict[Any, tuple[int, ...]]) -> None:
    """Gives a parameter its weight_loader and the global (unsharded) shape of each checkpoint shard it holds.

    global_shards maps shard_id (None for a plain parameter) to the full tensor's shape; dummy-weight
    initialisation uses it to generate the same global tensor on every rank.
    """
    param.weight_loader = loader
    param.global_shards = global_shards


def default_weight_loader(param: torch.nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """A replicated parameter: every rank holds the whole tensor."""
    copy_into(param.data, read_full(loaded), "replicated parameter")
