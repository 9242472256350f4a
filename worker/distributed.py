"""Tensor-parallel process group: init with an explicit timeout, the two collectives the layers need, and a
shutdown that cannot hang.

At world_size 1 no process group exists and every collective returns its input unchanged, so a single-rank
worker never touches torch.distributed. The state lives in one `_TPGroup` object (rank, size, whether a
group was created), not in scattered globals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class _TPGroup:
    rank: int = 0
    size: int = 1
    owns_process_group: bool = False  # True when init_distributed created a torch.distributed group


_group = _TPGroup()


def init_distributed(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Joins the TP group. backend: "gloo" (CPU), "nccl" (CUDA) or "auto" (nccl when CUDA is available)."""
    global _group
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if world_size == 1:
        _group = _TPGroup(rank=0, size=1, owns_process_group=False)
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),  # never the 30-minute default watchdog
        )
    _group = _TPGroup(rank=rank, size=world_size, owns_process_group=True)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the TP ranks, in place; returns x."""
    if _group.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's x (same shape on each) along the last dim, in rank order."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def destroy_distributed(timeout_s: float = 10.0) -> None:
    """Destroys the process group without waiting on it forever (NCCL's destroy has hung at exit on GPU hosts).

    The destroy runs in a daemon thread; if it has not finished after timeout_s we give up on it and let
    process exit reclaim the resources.
    """
    global _group
    owned = _group.owns_process_group
    _group = _TPGroup()
    if not owned or not dist.is_initialized():
        return
    thread = threading.Thread(target=_destroy_quietly, name="destroy-process-group", daemon=True)
    thread.start()
    thread.join(timeout_s)


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # a peer already gone: nothing left to tear down
        pass
