"""How much device memory the decode CUDA graphs (worker/cuda_graphs.py) will take, reserved before the KV cache is
sized: ModelRunner.profile_num_blocks asks leave_room_for_graphs for the block count that leaves room for them.

measure_graph_memory is a dry run on a one-block scratch cache: it captures the largest size, then a few graphs of
the smallest, reading free device memory (torch.cuda.mem_get_info) before and after; reserve = largest + (number of
sizes - 1) * one smallest + 10 % of the largest.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import cdiv
from shardserve.worker.cuda_graphs import (
    DecodeGraphRunner, graph_batch_sizes, graphs_unsupported_reason, release_memory, say,
)

PROBE_COPIES = 4  # graphs of the smallest size the memory dry run captures to measure one graph's cost


def leave_room_for_graphs(
    blocks: int, model: nn.Module, backend: AttentionBackend, config: EngineConfig, device: torch.device,
    dtype: torch.dtype,
) -> tuple[int, int | None]:
    """(a profiled block count minus what the decode graphs will take, the reserve in bytes or None).

    Only where graphs will be captured and the memory budget bound the count: a fixed num_kv_blocks or
    kv_cache_memory_gb is the user's choice, and a count capped at what max_num_seqs sequences can use had room.
    """
    from shardserve.worker.kv_cache import bytes_per_block, max_useful_blocks

    fixed = config.num_kv_blocks is not None or config.kv_cache_memory_gb is not None
    if graphs_unsupported_reason(config, device, backend) is not None or fixed:
        return blocks, None
    try:
        reserve = measure_graph_memory(model, backend, config, device, dtype)
    except Exception as exc:  # the real capture will most likely fail the same way and fall back to eager
        say(f"WARNING: CUDA graph dry run failed ({type(exc).__name__}: {exc}); no memory reserved for graphs")
        return blocks, None
    if blocks >= max_useful_blocks(config):
        return blocks, reserve
    left = blocks - cdiv(reserve, bytes_per_block(model, config.block_size, dtype))
    if left < 1:
        raise RuntimeError(
            f"no memory left for the KV cache after reserving {reserve / 2**20:.0f} MiB for CUDA graphs: "
            "lower max_num_seqs, raise gpu_memory_utilization, or set enforce_eager"
        )
    return left, reserve


def measure_graph_memory(
    model: nn.Module, backend: AttentionBackend, config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Bytes to keep free for the decode graphs: a dry run on a one-block scratch cache (see the module doc)."""
    from shardserve.worker.kv_cache import allocate_kv_cache

    sizes = graph_batch_sizes(config.max_num_seqs)
    scratch = allocate_kv_cache(model, 1, config.block_size, dtype, device)
    gc.collect()
    torch.cuda.synchronize(device)
    free_start = torch.cuda.mem_get_info(device)[0]
    runner = DecodeGraphRunner(model, scratch, backend, sizes, config.block_size, config.max_model_len, device)
    probes: list = []
    try:
        with torch.inference_mode():
            runner.capture([sizes[-1]])
            after_largest = torch.cuda.mem_get_info(device)[0]
            # Every other size adds its own graph (and maybe pool growth): measured over a few copies of the
            # smallest, so the driver's allocation granularity averages out.
            copies = min(PROBE_COPIES, len(sizes) - 1)
            if copies:
                probes = runner.probe(sizes[0], copies)
            each_other = max(0, after_largest - torch.cuda.mem_get_info(device)[0]) // max(copies, 1)
    finally:
        del runner, scratch, probes
        release_memory()
    largest = max(0, free_start - after_largest)
    return largest + (len(sizes) - 1) * each_other + largest // 10
