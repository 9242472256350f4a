"""The paged KV cache: its size (fixed, from a memory budget, or profiled on CUDA) and its allocation.

Per layer one K and one V tensor of [num_blocks, block_size, num_kv_heads_per_rank, head_dim] (the view: the
attention backend chooses the memory layout under it, kernels/backends.py: new_cache). Every rank holds
its own KV heads for every block, so block ids from the one controller-side block manager are valid on all ranks;
the block count all ranks use is the minimum of what each rank can hold.
"""

from __future__ import annotations

import socket
from typing import Callable

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import cdiv

DEFAULT_CPU_CACHE_GB = 1.0
_GIB = 1 << 30


def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes on this rank: K and V, every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads_per_rank * model.head_dim * element


def max_useful_blocks(config: EngineConfig) -> int:
    """More blocks than max_num_seqs full-length sequences (plus one block of slack each) can never be used."""
    blocks_per_seq = cdiv(config.max_model_len, config.block_size) + 1
    return config.max_num_seqs * blocks_per_seq


def profile_num_blocks(
    config: EngineConfig,
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    profile_forward: Callable[[], None] | None = None,
) -> int:
    """How many blocks this rank allocates.

    num_kv_blocks (config) fixes it; else kv_cache_memory_gb gives the budget; else on CPU 1 GiB, and on CUDA
    what is left of total * gpu_memory_utilization after the peak of a profiling forward (profile_forward runs
    the model on a max_num_batched_tokens batch) and the memory outside torch's allocator.
    """
    per_block = bytes_per_block(model, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        return _fits_host_memory(config.num_kv_blocks, per_block, device)
    if per_block == 0:  # a model without attention layers: any count works
        return max_useful_blocks(config)
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * _GIB)
    elif device.type == "cuda":
        budget = _cuda_budget(config, device, profile_forward)
    else:
        budget = int(DEFAULT_CPU_CACHE_GB * _GIB)
    blocks = min(budget // per_block, max_useful_blocks(config))
    if blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (budget {budget / _GIB:.2f} GiB, one block {per_block} bytes): "
            "raise gpu_memory_utilization or kv_cache_memory_gb, or lower max_num_batched_tokens"
        )
    return _fits_host_memory(int(blocks), per_block, device)


def _fits_host_memory(blocks: int, per_block: int, device: torch.device) -> int:
    """blocks, when a CPU cache of that size fits the memory this host has available. The CPU cache's pages are
    taken as they are written (cache_zeros), so a cache too large for the host would fail only once it filled:
    refused here instead, naming the sizes. Each rank checks its own share here; ranks that share a host are
    checked together by the executor (host_memory, cluster/executor.py)."""
    available = _available_host_memory() if device.type == "cpu" else None
    if available is not None and blocks * per_block > available:
        raise ValueError(
            f"the KV cache would take {blocks * per_block / _GIB:.2f} GiB on this rank ({blocks} blocks), more than "
            f"the {available / _GIB:.2f} GiB of memory this host has available: lower kv_cache_memory_gb "
            "(--kv-cache-memory-gb) or num_kv_blocks (--num-kv-blocks)"
        )
    return blocks


def host_memory(device: torch.device) -> tuple[str, int]:
    """(host id, bytes available) for a cache in host memory (CPU), else ("", 0). The id is the kernel's boot id:
    processes that share it share the machine's memory, whatever their hostnames or network namespaces."""
    if device.type != "cpu":
        return "", 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = socket.gethostname()
    return host, _available_host_memory() or 0


def _available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none to read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cuda_budget(config: EngineConfig, device: torch.device, profile_forward: Callable[[], None] | None) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if profile_forward is not None:
        profile_forward()
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + activations at the largest batch
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes, NCCL
    torch.cuda.empty_cache()
    return int(total * config.gpu_memory_utilization - peak - max(outside_torch, 0))


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    backend: AttentionBackend | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), zero-filled so that unwritten slots never hold NaN garbage (on the CPU lazily:
    kernels/backends.py: cache_zeros), in the layout the attention backend reads (AttentionBackend.new_cache)."""
    backend = backend or AttentionBackend()
    return [
        backend.new_cache(num_blocks, block_size, model.num_kv_heads_per_rank, model.head_dim, dtype, device)
        for _ in range(model.num_layers)
    ]
