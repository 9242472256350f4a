"""GPU suite, two GPUs: the one-shot symmetric-memory all-reduce turns on at TP=2 and sums like NCCL, eagerly and
replayed from a CUDA graph, with larger messages left to NCCL. Runs only on a host with two CUDA GPUs."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from shardserve.worker import distributed

    torch.cuda.set_device(rank)
    distributed.init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "nccl", 60.0)
    device = torch.device("cuda", rank)
    report = {"enabled": distributed.enable_one_shot_all_reduce(torch.bfloat16, device)}
    errors = {}
    for rows in (1, 64, 4096):  # 8 KiB and 512 KiB (one-shot), 32 MiB (NCCL)
        x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows + rank)).to(device, torch.bfloat16)
        expected = x.float() + torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows + 1 - rank)).to(
            device, torch.bfloat16).float()
        got = distributed.all_reduce(x.clone())
        errors[f"eager_{rows}"] = float((got.float() - expected).abs().max())
    def operand(step: int, r: int) -> torch.Tensor:  # what rank r holds before replay `step` (reproducible)
        return torch.randn(8, 4096, generator=torch.Generator().manual_seed(1000 * step + r)).to(device, torch.bfloat16)

    static = operand(0, rank)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        distributed.all_reduce(static * 1)  # warm-up outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        summed = distributed.all_reduce(static * 1)
    for step in range(1, 4):
        static.copy_(operand(step, rank))  # new inputs before every replay
        graph.replay()
        torch.cuda.synchronize()
        expected = operand(step, 0).float() + operand(step, 1).float()
        errors[f"graph_replay_{step}"] = float((summed.float() - expected).abs().max())
    report["errors"] = errors
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    distributed.destroy_distributed()


def test_one_shot_all_reduce_on_two_gpus(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "SHARDSERVE_SYMM_MEM_ALL_REDUCE": "1"}  # opt-in (off by default)
    for name, value in env.items():  # inherited by the spawned ranks, restored after the test
        monkeypatch.setenv(name, value)
    mp.spawn(_rank_main, args=(port, str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["enabled"], "the one-shot path did not turn on at TP=2 (see the warning above)"
        for name, err in report["errors"].items():
            assert err < 0.07, (name, err)  # one bf16 rounding of a sum of two N(0, 1)
