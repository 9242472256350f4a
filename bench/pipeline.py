"""`shardserve bench pipeline`: pipeline stages with several batches in flight against the same stages running one
batch at a time, on the offline workload, and each stage's bubble.

Both runs use the same engine settings (`-pp N`, default 2, with any `-tp`) and the same random prompts; the only
difference is async scheduling: on, the engine keeps up to N plans in flight, each on its own share of the
requests (cluster/scheduler.py); off, it sends the next plan only once the last one's result is back, all the
requests in one batch. A stage's bubble is the share of the run's wall time its ranks did not work: 1 - (the sum of
their StepResult.forward_ms, which leaves out the time a stage waits for the one before it: worker/stage_link.py)
/ the wall time, the mean over the stage's TP ranks.
"""

from __future__ import annotations

import argparse
import os

from shardserve.bench.harness import open_engine, run_workload, warm_up
from shardserve.bench.measure import free_device_memory
from shardserve.bench.record import BenchRecord
from shardserve.bench.workload import parse_range, random_workload

MODES = {"in_flight": True, "one_at_a_time": False}  # mode -> async_scheduling


def stage_bubbles(busy_ms_by_rank: list[float], tp: int, elapsed_s: float) -> list[float]:
    """Each stage's share of elapsed_s spent idle: 1 - its ranks' mean busy time / elapsed_s (ranks stage-major)."""
    stages = [busy_ms_by_rank[i : i + tp] for i in range(0, len(busy_ms_by_rank), tp)]
    return [1.0 - (sum(ms) / len(ms)) / 1e3 / elapsed_s for ms in stages]


def run_mode(config, workload, temperature: float, seed: int, vocab: int) -> dict:
    bench = open_engine(config)
    try:
        warm_up(bench, vocab)
        grpc = bench.executor.inner  # a GrpcExecutor: every rank's own time, summed
        before = list(grpc.forward_ms_by_rank)
        run = run_workload(bench, workload, temperature, seed)
        busy = [after - b for after, b in zip(grpc.forward_ms_by_rank, before)]
        return dict(output_tokens_per_s=run.output_tokens / run.elapsed_s, elapsed_s=run.elapsed_s,
                    steps=len(run.step_ms), output_tokens=run.output_tokens,
                    bubble_by_stage=stage_bubbles(busy, config.tensor_parallel_size, run.elapsed_s))
    finally:
        bench.close()
        free_device_memory()


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.settings.resolve import build_engine_config, read_model_facts

    if engine_kwargs.get("pipeline_parallel_size", 1) == 1:
        engine_kwargs["pipeline_parallel_size"] = 2
    engine_kwargs.pop("async_scheduling", None)
    configs = {mode: build_engine_config(offline=True, async_scheduling=on, **engine_kwargs)
               for mode, on in MODES.items()}
    config = configs["in_flight"]
    vocab = read_model_facts(config.model).vocab_size
    workload = random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab,
                               seed=args.seed)
    print(f"workload: {len(workload.prompts)} prompts, {workload.num_prompt_tokens} prompt tokens, "
          f"{workload.num_output_tokens} output tokens; device {config.device}, dtype {config.dtype}, "
          f"pp {config.pipeline_parallel_size} x tp {config.tensor_parallel_size}", flush=True)
    results = {}
    for mode in args.order.split(","):
        results[mode] = run_mode(configs[mode], workload, args.temperature, args.seed, vocab)
        r = results[mode]
        print(f"{mode}: {r['output_tokens']} tokens in {r['elapsed_s']:.2f} s = {r['output_tokens_per_s']:.1f} "
              f"output tok/s, {r['steps']} steps; bubble by stage: "
              + ", ".join(f"{b:.1%}" for b in r["bubble_by_stage"]), flush=True)
    speedup = results["in_flight"]["output_tokens_per_s"] / results["one_at_a_time"]["output_tokens_per_s"]
    print(f"in flight / one at a time: {speedup:.2f}x", flush=True)
    record = BenchRecord.for_engine(
        "pipeline", args.model, config,
        workload=dict(num_prompts=len(workload.prompts), input_len=args.input_len, output_len=args.output_len,
                      temperature=args.temperature, ignore_eos=True),
        output_tokens_per_s=results["in_flight"]["output_tokens_per_s"])
    record.notes.update(results, speedup_in_flight_vs_one_at_a_time=speedup, cpu=_cpu_model(),
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
    record.write(args.json_out)
    if args.json_out:
        print(f"record: {os.path.abspath(args.json_out)}", flush=True)
    return 0


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def add_parser(kinds, add_engine_args, run) -> None:
    p = kinds.add_parser("pipeline", help="pipeline stages: batches in flight against one batch at a time, "
                                          "and each stage's bubble")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=16, help="how many random prompts")
    p.add_argument("--input-len", default="32-128", help="N or LOW-HIGH (uniform)")
    p.add_argument("--output-len", default="32-128", help="N or LOW-HIGH (uniform)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    p.add_argument("--order", default="one_at_a_time,in_flight", help="the modes, in the order they run")
    p.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    p.set_defaults(func=run)
