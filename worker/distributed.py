"""Tensor-parallel process group: init with an explicit timeout, the two collectives the layers need, and a
shutdown that cannot hang.

At world_size 1 no process group exists and every collective returns its input unchanged, so a single-rank
worker never touches torch.distributed. The state lives in one `_TPGroup` object (rank, size, whether a
group was created), not in scattered globals.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _TPGroup:
    rank: int = 0
    size: int = 1
    owns_process_group: bool = False  # True when init_distributed created a torch.distributed group
    group: Any = None  # the TP group's torch ProcessGroup when the world also holds other pipeline stages


_group = _TPGroup()

# Multicast over NVLink must stay off on the multi-GPU hosts (environment notes). Every rank's process sets these
# before it joins its group (prepare_worker_process); the launcher also passes them in the Ray actors' runtime_env.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def cpu_threads_per_rank(device: str, ranks_on_host: int) -> int | None:
    """torch's intra-op threads for each CPU rank: the ranks on a host share its cores (one process each with all
    of them would oversubscribe them). None on CUDA: torch's default."""
    if device == "cuda":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # taskset, cpusets
    return max(1, (cores or 1) // ranks_on_host)


def prepare_worker_process(num_threads: int | None = None) -> None:
    """What a rank's process sets before it serves: multicast off, and torch's intra-op threads where given
    (cpu_threads_per_rank)."""
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)
    if num_threads is not None:
        torch.set_num_threads(max(1, num_threads))


def init_distributed(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
                     bind_host: str | None = None, tp: int | None = None) -> None:
    """Joins the replica's process group. backend: "gloo" (CPU), "nccl" (CUDA) or "auto" (nccl when CUDA is available).
    tp: the TP group's size where the world is several pipeline stages of tp ranks each (proto/stages.py): every
    rank then makes every stage's TP group (new_group is collective over the world), and the layers' collectives
    run in its own; the stages' activations cross between them point to point (worker/stage_link.py).

    A "tcp://host:port" rendezvous is a TCPStore that rank 0 serves on a socket it binds to that host itself
    (torch's own tcp:// init listens on every interface); bind_host, the address this worker was given, also
    pins the interface gloo's and NCCL's own sockets listen on (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless
    already set). None or an all-interfaces address leaves those to torch."""
    global _group
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    tp = world_size if tp is None else tp
    if world_size % tp:
        raise ValueError(f"world_size {world_size} is not a multiple of the TP size {tp}")
    if world_size == 1:
        _group = _TPGroup(rank=0, size=1, owns_process_group=False)
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)  # never the 30-minute default watchdog
        interface = interface_of(bind_host) if bind_host else None
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        if init_method.startswith("tcp://"):
            store = _tcp_store(init_method, rank, world_size, timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
    group = None
    if tp < world_size:
        for first in range(0, world_size, tp):  # every rank makes every group, in the same order
            made = dist.new_group(list(range(first, first + tp)), timeout=timedelta(seconds=timeout_s)) if tp > 1 else None
            if first <= rank < first + tp:
                group = made
    _group = _TPGroup(rank=rank % tp, size=tp, owns_process_group=True, group=group)


def _tcp_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store; rank 0 serves it on a listening socket bound to the rendezvous host only."""
    import socket

    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    # The store owns the descriptor from here (detach: Python must not close it under the store).
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` ("lo" for 127.0.0.1), or None for an all-interfaces address
    or one no interface holds."""
    import psutil

    if address in ("", "0.0.0.0", "::", "[::]"):
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address.strip("[]") for a in addrs):
            return name
    return None


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the TP ranks in place (NCCL on CUDA, gloo on CPU) and returns it."""
    if _group.size > 1:
        dist.all_reduce(x, group=_group.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's x (same shape on each) along the last dim, in rank order."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x, group=_group.group)
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
