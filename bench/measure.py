"""What the benchmarks measure around an engine run: one workload on one engine (runs, CUDA graphs, peak
memory), freeing the device between engines, and the control plane's share of the decode steps."""

from __future__ import annotations

import gc

from shardserve.bench.harness import EngineRun, median, open_engine, run_workload, warm_up
from shardserve.bench.profile import profiled
from shardserve.bench.workload import Workload


def peak_memory_gb(device: str, tp: int = 1) -> float | None:
    """This process's peak: the engine's at TP=1 (in-process); None on CUDA at TP>1 (the ranks are other processes)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if tp == 1 else None
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engine(config, workload: Workload, temperature: float, seed: int, vocab: int, executor: str = "local",
               sample: Workload | None = None, profile_path: str | None = None, progress: str | None = None,
               repeats: int = 1) -> tuple[list[EngineRun], EngineRun | None, str | None, float]:
    """Runs the workload `repeats` times on one engine (run k with Workload.shifted(k): the same lengths, no prefix
    hits on the earlier runs; only the first profiled), then the transformers sample, when given; returns the runs,
    the sample's run, what the runner captured as CUDA graphs, and this process's peak memory. progress: a label
    for a progress bar (stderr) over each timed run's output tokens."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    bench = open_engine(config, executor)
    try:
        warm_up(bench, vocab)
        with profiled(profile_path, config.device):
            runs = [run_workload(bench, workload, temperature, seed, progress=progress)]
        for k in range(1, repeats):
            runs.append(run_workload(bench, workload.shifted(k, vocab), temperature, seed, progress=progress))
        run = runs[0]
        sample_run = None
        if sample is not None:
            same = sample.prompts == workload.prompts and sample.output_lens == workload.output_lens
            sample_run = run if same else run_workload(bench, sample, temperature, seed)
        return runs, sample_run, bench.graphs, peak_memory_gb(config.device, config.tensor_parallel_size)
    finally:
        bench.close()
        free_device_memory()


def control_plane_share(run: EngineRun, min_batch: int) -> dict:
    """1 - sum(workers' forward_ms) / sum(controller step ms) over the decode steps with >= min_batch sequences
    (bench/control_plane.py says what it measures), with the medians it comes from."""
    steps = run.decode_steps(min_batch)
    total = sum(ms for ms, _ in steps)
    return dict(
        share=1.0 - sum(t.forward_ms for _, t in steps) / total if total > 0 else None,
        median_step_ms=median([ms for ms, _ in steps]),
        median_forward_ms=median([t.forward_ms for _, t in steps]),
        decode_steps=len(steps),
        min_batch=min_batch,
    )
