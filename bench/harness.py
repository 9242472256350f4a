"""Driving an Engine for benchmarks: over any executor (in-process/local processes, or the Ray + gRPC cluster),
with every step timed on the controller side and the workers' own step time (StepResult.forward_ms) beside it.

The difference between the two is the control plane: planning, encoding, transport, decoding and bookkeeping
around the worker's step.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from shardserve.bench.workload import Workload
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult

EXECUTORS = ("local", "cluster")  # local: in-process at TP=1, local worker processes over gRPC at TP>1


@dataclass
class StepTiming:
    num_seqs: int  # sequences in the plan
    num_tokens: int  # tokens computed
    decode_only: bool
    forward_ms: float  # the slowest rank's own time for the step (inputs, forward, sampling)


@dataclass
class EngineRun:
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int
    step_ms: list[float] = field(default_factory=list)  # controller-side wall time of each engine.step()
    steps: list[StepTiming | None] = field(default_factory=list)  # the executor step inside it (None: no step)
    step_tokens: list[int] = field(default_factory=list)  # output tokens each engine.step() delivered

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def decode_steps(self, min_batch: int = 1) -> list[tuple[float, StepTiming]]:
        """(controller ms, timing) of decode-only steps with at least min_batch sequences."""
        return [(ms, t) for ms, t in zip(self.step_ms, self.steps)
                if t is not None and t.decode_only and t.num_seqs >= min_batch]


def phase_split(run: EngineRun) -> dict:
    """Where the run's wall time went: steps with prefill tokens vs decode-only steps (by batch size range). Beside
    each wall time, the workers' own (device_s: StepResult.forward_ms, on CUDA the device time between the first
    and the last kernel of a step that samples, else host time): where it falls short of the wall time, the device
    waited for the host between steps."""
    out: dict = {"prefill_steps": 0, "prefill_s": 0.0, "prefill_device_s": 0.0, "decode_steps": 0, "decode_s": 0.0,
                 "decode_device_s": 0.0, "decode_by_batch": {},
                 "first_step_s": run.step_ms[0] / 1e3 if run.step_ms else 0.0, "untimed_steps_s": 0.0,
                 "outside_steps_s": run.elapsed_s - sum(run.step_ms) / 1e3}
    for ms, timing in zip(run.step_ms, run.steps):
        if timing is None:  # submitted a plan without collecting one (async scheduling's first step)
            out["untimed_steps_s"] += ms / 1e3
            continue
        kind = "decode" if timing.decode_only else "prefill"
        out[f"{kind}_steps"] += 1
        out[f"{kind}_s"] += ms / 1e3
        out[f"{kind}_device_s"] += timing.forward_ms / 1e3
        if timing.decode_only:
            low = 1 << (timing.num_seqs.bit_length() - 1)  # 1, 2-3, 4-7, ..., 128-255, 256-511
            bucket = out["decode_by_batch"].setdefault(f"{low}-{2 * low - 1}",
                                                       {"steps": 0, "s": 0.0, "device_s": 0.0, "tokens": 0})
            bucket["steps"] += 1
            bucket["s"] += ms / 1e3
            bucket["device_s"] += timing.forward_ms / 1e3
            bucket["tokens"] += timing.num_seqs
    for bucket in out["decode_by_batch"].values():
        bucket["ms_per_step"] = bucket["s"] * 1e3 / bucket["steps"]
        bucket["device_ms_per_step"] = bucket["device_s"] * 1e3 / bucket["steps"]
    return out


class TimedExecutor:
    """Wraps an executor: records each step's plan shape and the workers' forward_ms, changes nothing else."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_kv_blocks = inner.num_kv_blocks
        self.timings: list[StepTiming] = []
        self._submitted: deque[StepPlan] = deque()
        if hasattr(inner, "submit") and hasattr(inner, "collect"):
            self.submit, self.collect = self._submit, self._collect

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        self._record(plan, result)
        return result

    def _submit(self, plan: StepPlan) -> None:
        self.inner.submit(plan)
        self._submitted.append(plan)

    def _collect(self) -> StepResult:
        result = self.inner.collect()
        self._record(self._submitted.popleft(), result)
        return result

    def _record(self, plan: StepPlan, result: StepResult) -> None:
        forward_ms = getattr(self.inner, "last_forward_ms", None) or result.forward_ms  # GrpcExecutor: slowest rank
        self.timings.append(StepTiming(len(plan.req_ids), plan.num_batched_tokens,
                                       all(n == 1 for n in plan.num_tokens), forward_ms))

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class BenchEngine:
    engine: Any  # shardserve.cluster.engine.Engine
    executor: TimedExecutor
    config: EngineConfig
    close: Callable[[], None]
    graphs: str | None = None  # what the in-process runner captured, where visible


def open_engine(config: EngineConfig, executor: str = "local") -> BenchEngine:
    """An Engine over a timed executor. "cluster": a local Ray (loopback), one placement group, GrpcExecutor."""
    from shardserve.settings.engine_factory import build_engine

    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    closers: list[Callable[[], None]] = []
    if executor == "local":
        from shardserve.api.local_executors import create_executor as make_executor
    else:
        from shardserve.launch.placement import ensure_ray, launch_worker_group
        from shardserve.launch.ray_serving import GrpcExecutorFactory

        ensure_ray("local")
        group = launch_worker_group(config, startup_timeout_s=300.0)
        closers.append(group.shutdown)
        make_executor = GrpcExecutorFactory(group.endpoints, group.init_method, group.secret)
    try:
        engine = build_engine(config, lambda cfg: TimedExecutor(make_executor(cfg)))
    except BaseException:
        for closer in closers:
            closer()
        raise
    timed = engine.executor
    closers.insert(0, timed.shutdown)

    def close() -> None:
        for closer in closers:
            try:
                closer()
            except Exception as exc:  # shutdown is best effort; the next benchmark must still run
                print(f"warning: shutdown step failed: {exc!r}")

    return BenchEngine(engine, timed, config, close, graphs=_graphs_summary(timed.inner))


def _graphs_summary(executor: Any) -> str | None:
    runner = getattr(executor, "runner", None)
    if runner is None:
        return None  # another process: its workers print what they captured
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None:
        return "off (eager decode)"
    return (f"{len(graphs.batch_sizes)} sizes {graphs.batch_sizes[0]}..{graphs.batch_sizes[-1]}, "
            f"{graphs.memory_bytes / 2**20:.0f} MiB, captured in {graphs.capture_s:.1f} s")


def run_workload(bench: BenchEngine, workload: Workload, temperature: float, seed: int = 0,
                 progress: str | None = None) -> EngineRun:
    """Adds every prompt (ignore_eos, fixed max_tokens), steps the engine until all finish, times each step.
    progress: a label for a tqdm bar on stderr over the output tokens (its rate and ETA), None for none."""
    from shardserve.cluster.sampling_params import SamplingParams

    engine = bench.engine
    ids = []
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        req_id = f"bench-{seed}-{i}"
        engine.admit(req_id, list(prompt), SamplingParams(temperature=temperature, max_tokens=n,
                                                                ignore_eos=True, seed=seed + i))
        ids.append(req_id)
    run = EngineRun(0.0, 0, workload.num_prompt_tokens)
    timings = bench.executor.timings
    bar = None
    if progress is not None:
        from tqdm import tqdm

        bar = tqdm(total=workload.num_output_tokens, desc=progress, unit="tok", file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    while engine.has_unfinished():
        before = len(timings)
        t0 = time.perf_counter()
        deltas = engine.step()
        run.step_ms.append((time.perf_counter() - t0) * 1e3)
        run.steps.append(timings[-1] if len(timings) > before else None)
        new_tokens = sum(len(d.token_ids) for d in deltas)
        run.step_tokens.append(new_tokens)
        run.output_tokens += new_tokens
        if bar is not None:
            bar.update(new_tokens)
    run.elapsed_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    for req_id in ids:
        engine.pop_output(req_id)
    return run


def warm_up(bench: BenchEngine, vocab_size: int, batch: int = 2) -> None:
    """A few short requests: kernels compiled and first-use costs paid before anything is timed."""
    prompts = [[100 + (7 * i + j) % max(1, vocab_size - 100) for j in range(16)] for i in range(batch)]
    run_workload(bench, Workload(prompts, [4] * batch), temperature=0.0, seed=10_000)


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None
