"""The one JSON record every benchmark writes (`--json-out`); docs/results/ keeps the ones docs/performance.md quotes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field, is_dataclass


@dataclass
class Stats:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Stats | None":
        if not values:
            return None
        ordered = sorted(values)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

        return cls(mean=sum(ordered) / len(ordered), p50=pct(0.5), p99=pct(0.99))


@dataclass
class BenchRecord:
    benchmark: str  # "offline", "latency", "serve" or "scaling"
    model: str
    load_format: str
    device: str
    num_gpus: int
    tp: int
    replicas: int | None = None
    pp: int = 1  # pipeline stages (each of tp ranks)
    dtype: str | None = None  # the model's (weights' and activations') dtype: "bfloat16", "float32" ...
    kv_cache_dtype: str | None = None  # the KV cache's element type: "bfloat16", "float32", "fp8" ...
    quantization: str | None = None  # the linear layers' weights: "none" (the model's dtype) or "fp8"
    settings: dict = field(default_factory=dict)  # the run's EngineConfig, every field as resolved
    workload: dict = field(default_factory=dict)  # num_prompts, input_len, output_len, rate or concurrency
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    ceiling_output_tokens_per_s: float | None = None
    ms_per_token: float | None = None
    ratio_vs_hf: float | None = None
    control_plane_share: float | None = None
    speedup_vs_1: float | None = None
    ttft_ms: Stats | None = None
    tpot_ms: Stats | None = None
    itl_ms: Stats | None = None
    e2e_ms: Stats | None = None
    peak_memory_gb: float | None = None
    command: str = field(default_factory=lambda: "shardserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    commit: str | None = field(default_factory=lambda: _git_commit())
    notes: dict = field(default_factory=dict)  # benchmark-specific extras (the ceiling arithmetic, ...)

    @classmethod
    def for_engine(cls, benchmark: str, model: str | None, config, **fields) -> "BenchRecord":
        """A record whose model/device/TP fields come from the run's EngineConfig."""
        tp = config.tensor_parallel_size
        return cls(benchmark=benchmark, model=model or "SmolLM2-135M-Instruct", load_format=config.load_format,
                   device=device_name(config.device), num_gpus=tp if config.device == "cuda" else 0, tp=tp,
                   replicas=1, pp=getattr(config, "pipeline_parallel_size", 1), dtype=getattr(config, "dtype", None),
                   kv_cache_dtype=getattr(config, "kv_cache_dtype", None),
                   quantization=getattr(config, "quantization", None),
                   settings=asdict(config) if is_dataclass(config) else {}, **fields)

    def write(self, path: str | None) -> None:
        text = json.dumps(asdict(self), indent=2)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")


def _git_commit() -> str | None:
    """SHARDSERVE_COMMIT when set (a copied tree whose .git is not the one it came from: the GPU hosts), else
    the checkout's HEAD, marked "+dirty" when tracked files differ from it."""
    if os.environ.get("SHARDSERVE_COMMIT"):
        return os.environ["SHARDSERVE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        head = out.stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(["git", "-C", here, "diff", "--quiet", "HEAD"], capture_output=True,
                               timeout=5).returncode
        return head + ("+dirty" if dirty else "")
    except Exception:
        return None


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
