"""`shardserve bench control-plane`: the share of each step spent outside the workers' own step, in steady-state
decode (every request in the batch, batch >= 64 by default), through the Ray + gRPC cluster and through local
worker processes.

Over the steady-state decode steps: the controller's wall time of engine.step() (scheduling, plan encoding,
transport, the workers, result decoding, bookkeeping) against the slowest worker's forward_ms, which on CUDA is the
step's device time (CUDA events around its kernels: inputs, forward, sampling). share = 1 - sum(forward) /
sum(step): the fraction of the time the GPU is not working on a step, i.e. waiting for the control plane. With
async scheduling and launch-ahead a step's device time overlaps the controller's next step, so per-step ratios
mean little; the sums over the window are what the GPU could have done against what it did. On CPU forward_ms is
host time and the share is the time outside the workers' step calls.
"""

from __future__ import annotations

import argparse

from shardserve.bench.measure import control_plane_share, run_engine
from shardserve.bench.record import BenchRecord
from shardserve.bench.workload import random_workload


def ray_importable() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.settings.resolve import build_engine_config, read_model_facts

    config = build_engine_config(**engine_kwargs)
    vocab = read_model_facts(config.model).vocab_size
    workload = random_workload(args.num_prompts, (args.input_len, args.input_len), (args.output_len, args.output_len),
                               vocab, seed=args.seed)
    min_batch = args.min_batch or args.num_prompts
    executors = ["cluster", "local"] if args.executor == "both" else [args.executor]  # the cluster first
    local_name = "in-process" if config.tensor_parallel_size == 1 else "local processes"
    results: dict[str, dict] = {}
    record = BenchRecord.for_engine(
        "offline", args.model, config,
        workload=dict(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                      temperature=args.temperature, ignore_eos=True),
    )
    record.notes.update(measure="control_plane", executors=results,
                        definition="1 - sum(slowest worker forward_ms) / sum(controller step ms) over the decode "
                                   "steps with batch >= min_batch; forward_ms is device time on CUDA (events), "
                                   "host time on CPU; the headline is the cluster's")
    for executor in executors:
        name = "cluster (Ray + gRPC)" if executor == "cluster" else local_name
        if executor == "cluster" and not ray_importable():
            results[executor] = dict(error="ray is not importable")
            print(f"{name}: skipped, ray is not importable", flush=True)
            continue
        try:
            (run,), _, graphs, _ = run_engine(config, workload, args.temperature, args.seed, vocab, executor=executor)
        except Exception as exc:  # report and go on: the other executor may still measure
            results[executor] = dict(error=f"{type(exc).__name__}: {exc}")
            print(f"{name}: failed: {exc!r}", flush=True)
            continue
        share = control_plane_share(run, min_batch)
        share.update(output_tokens_per_s=run.output_tokens_per_s, cuda_graphs=graphs)
        results[executor] = share
        if share["share"] is None:
            print(f"{name}: no decode step with >= {min_batch} sequences", flush=True)
        else:
            print(f"{name}: decode step {share['median_step_ms']:.3f} ms at the controller, "
                  f"{share['median_forward_ms']:.3f} ms in the workers -> control plane {share['share']:.1%} "
                  f"({share['decode_steps']} steps, batch >= {min_batch}); {run.output_tokens_per_s:.0f} output tok/s",
                  flush=True)
        record.control_plane_share = _headline(results)
        record.write(args.json_out)  # after each executor: a later hang or kill keeps what was measured
    cluster_tok_s = results.get("cluster", {}).get("output_tokens_per_s")
    local_tok_s = results.get("local", {}).get("output_tokens_per_s")
    if cluster_tok_s and local_tok_s:
        record.notes["cluster_to_local_throughput"] = cluster_tok_s / local_tok_s
        print(f"cluster / {local_name}: {cluster_tok_s / local_tok_s:.3f}x output tok/s", flush=True)
    record.control_plane_share = _headline(results)
    record.write(args.json_out)
    return 0 if record.control_plane_share is not None else 1


def _headline(results: dict[str, dict]) -> float | None:
    """The cluster's share where measured, else the local executor's."""
    for executor in ("cluster", "local"):
        share = results.get(executor, {}).get("share")
        if share is not None:
            return share
    return None
