"""LLM's executors, all on this host: the model in this process for one rank and one engine, else one local process per
rank serving the Worker gRPC service on loopback (worker/local_workers.py), driven by a GrpcExecutor."""

from __future__ import annotations

from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import world_size


def create_executor(config: EngineConfig, group: int = 0, groups: int = 1):
    """TP=1 runs the model in this process. TP > 1 (or one of several groups) runs one local process per rank,
    each serving the Worker gRPC service on loopback (joined by torch.distributed), driven by a GrpcExecutor that
    stops them with itself."""
    if world_size(config) == 1 and groups == 1:
        from shardserve.worker.inprocess import InProcessExecutor

        return InProcessExecutor(config)
    from shardserve.cluster.executor import GrpcExecutor
    from shardserve.worker.local_workers import start_local_workers

    workers = start_local_workers(config, group=group, groups=groups)
    try:
        return GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop,
                            secret=workers.secret)
    except BaseException:
        workers.stop(timeout_s=0.0)
        raise


def check_local_devices(config: EngineConfig, groups: int) -> None:
    """LLM runs every rank on this host: CUDA ranks need that many GPUs here (one line, before loading anything)."""
    if config.device != "cuda":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = world_size(config) * groups
    if have < need:
        raise ValueError(
            f"--device cuda (device='cuda') with --tp {config.tensor_parallel_size} x --pp "
            f"{config.pipeline_parallel_size} x {groups} group(s) needs "
            f"{need} CUDA GPU(s) on this host; it has {have}"
        )
