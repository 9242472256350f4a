"""`shardserve bench offline`: output tokens/s of a whole batch of random prompts (nano-vllm's workload by
default), against the hardware ceiling of that very workload (bench/roofline.py), optionally against
transformers (--compare hf) and through the Ray + gRPC cluster (--cluster)."""

from __future__ import annotations

import argparse
import os

from shardserve.bench.harness import EngineRun, phase_split
from shardserve.bench.measure import control_plane_share, run_engine
from shardserve.bench.record import BenchRecord
from shardserve.bench.workload import Workload, parse_range, random_workload


def ceiling(config, workload: Workload, rates) -> dict | None:
    """The workload's ceiling (bench/roofline.py) for this model and TP; printed with its arithmetic."""
    from shardserve.bench.roofline import ModelShape, workload_ceiling

    if rates is None:
        return None
    shape = ModelShape.of_engine(config)  # the KV bytes per token follow kv_cache_dtype
    result = workload_ceiling(shape, rates, [len(p) for p in workload.prompts], workload.output_lens)
    print("ceiling arithmetic:\n  " + "\n  ".join(result["arithmetic"]))
    return result


# The workload when not given: nano-vllm's on a GPU; on a CPU one that ends in about a minute with the default model.
DEFAULTS = {"cuda": dict(num_prompts="256", input_len="100-1024", output_len="100-1024"),
            "cpu": dict(num_prompts="16", input_len="32-128", output_len="32-128")}


def resolve_workload_args(args: argparse.Namespace, device: str) -> None:
    """Fills the "auto" workload flags for the device the engine runs on."""
    for name, value in DEFAULTS["cuda" if device == "cuda" else "cpu"].items():
        if getattr(args, name) == "auto":
            setattr(args, name, value)
    try:
        args.num_prompts = int(args.num_prompts)
    except ValueError:
        raise ValueError(f"--num-prompts must be an integer or auto, got {args.num_prompts!r}") from None


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.roofline import measure_rates
    from shardserve.settings.resolve import build_engine_config, read_model_facts

    config = build_engine_config(offline=True, **engine_kwargs)
    resolve_workload_args(args, config.device)
    vocab = read_model_facts(config.model).vocab_size
    # The rates first: the engine takes most of the device memory once it runs.
    rates = None if args.no_roofline else measure_rates(config.device)
    workload = random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab,
                               seed=args.seed)
    sample = None
    if args.compare == "hf":  # transformers runs a sample with one fixed output length; ours runs the same sample
        fixed = max(workload.output_lens)
        n = min(args.hf_prompts, len(workload.prompts))
        sample = Workload(workload.prompts[:n], [fixed] * n)
    print(f"workload: {len(workload.prompts)} prompts, {workload.num_prompt_tokens} prompt tokens, "
          f"{workload.num_output_tokens} output tokens; device {config.device}, dtype {config.dtype}, "
          f"tp {config.tensor_parallel_size}, pp {config.pipeline_parallel_size}", flush=True)
    runs, sample_run, graphs, peak = run_engine(config, workload, args.temperature, args.seed, vocab, sample=sample,
                                                profile_path=args.profile, progress="shardserve",
                                                repeats=args.repeats)
    phases_of = [phase_split(each) for each in runs]
    for k, (each, each_phases) in enumerate(zip(runs, phases_of) if len(runs) > 1 else []):
        print(f"run {k + 1} of {len(runs)}: {each.output_tokens_per_s:.1f} output tok/s in {each.elapsed_s:.2f} s; "
              f"prefill {each_phases['prefill_s']:.2f} s (workers {each_phases['prefill_device_s']:.2f}), "
              f"decode {each_phases['decode_s']:.2f} s (workers {each_phases['decode_device_s']:.2f})", flush=True)
    order = sorted(range(len(runs)), key=lambda k: runs[k].output_tokens_per_s)
    headline = order[(len(runs) - 1) // 2]  # the median run (the lower of the two middle ones)
    run = runs[headline]
    tok_s = run.output_tokens_per_s
    print(f"shardserve: {run.output_tokens} tokens in {run.elapsed_s:.2f} s = {tok_s:.1f} output tok/s "
          f"(CUDA graphs: {graphs or 'see the worker logs'})", flush=True)
    record = BenchRecord.for_engine(
        "offline", args.model, config,
        workload=dict(num_prompts=len(workload.prompts), input_len=args.input_len, output_len=args.output_len,
                      temperature=args.temperature, ignore_eos=True),
        output_tokens_per_s=tok_s,
        total_tokens_per_s=(run.output_tokens + run.prompt_tokens) / run.elapsed_s,
        peak_memory_gb=peak,
    )
    phases = phases_of[headline]
    print(f"phases: first step {phases['first_step_s']:.3f} s, untimed steps {phases['untimed_steps_s']:.3f} s, "
          f"outside steps {phases['outside_steps_s']:.3f} s; "
          f"{phases['prefill_steps']} steps with prefill in {phases['prefill_s']:.2f} s "
          f"(workers {phases['prefill_device_s']:.2f} s), {phases['decode_steps']} decode-only steps in "
          f"{phases['decode_s']:.2f} s (workers {phases['decode_device_s']:.2f} s); decode ms/step by batch, "
          "wall / workers': " + ", ".join(f"{k}: {v['ms_per_step']:.2f} / {v['device_ms_per_step']:.2f} ({v['steps']})"
                                          for k, v in phases["decode_by_batch"].items()),
          flush=True)
    record.notes.update(elapsed_s=run.elapsed_s, output_tokens=run.output_tokens, steps=len(run.step_ms), phases=phases,
                        cuda_graphs=graphs, max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=config.max_num_batched_tokens)
    if len(runs) > 1:
        record.notes["repeats"] = dict(
            headline=f"run {headline + 1}: the median of {len(runs)} runs on one engine (each with other prompt "
                     "tokens of the same lengths), its figure and phases above",
            runs=[_summary(each, p) for each, p in zip(runs, phases_of)])
    bound = ceiling(config, workload, rates)
    if bound is not None and bound["ceiling_output_tokens_per_s"]:
        record.ceiling_output_tokens_per_s = bound["ceiling_output_tokens_per_s"]
        record.notes["ceiling"] = bound
        record.notes["fraction_of_ceiling"] = tok_s / bound["ceiling_output_tokens_per_s"]
        print(f"fraction of the ceiling: {tok_s:.0f} / {bound['ceiling_output_tokens_per_s']:.0f} = "
              f"{record.notes['fraction_of_ceiling']:.1%}", flush=True)
    # vLLM's `bench throughput` summary, in its words, for those who compare the two
    print(f"Throughput: {len(workload.prompts) / run.elapsed_s:.2f} requests/s, "
          f"{record.total_tokens_per_s:.2f} total tokens/s, {tok_s:.2f} output tokens/s", flush=True)
    record.write(args.json_out)  # kept if a comparison below fails or hangs
    if args.json_out:
        print(f"record: {os.path.abspath(args.json_out)}", flush=True)
    if args.cluster:
        _compare_cluster(args, config, workload, vocab, tok_s, record)
        record.write(args.json_out)
    if sample_run is not None:
        _compare_hf(args, config, sample, sample_run, record)
        record.write(args.json_out)
    if args.json_out and (args.cluster or sample_run is not None):
        print(f"record (with the comparisons): {os.path.abspath(args.json_out)}", flush=True)
    return 0


def _summary(run: EngineRun, phases: dict) -> dict:
    keep = ("prefill_s", "prefill_device_s", "decode_s", "decode_device_s")
    return dict(output_tokens_per_s=run.output_tokens_per_s, elapsed_s=run.elapsed_s, **{k: phases[k] for k in keep})


def _compare_cluster(args, config, workload: Workload, vocab: int, local_tok_s: float, record: BenchRecord) -> None:
    (run,), _, _, _ = run_engine(config, workload, args.temperature, args.seed, vocab, executor="cluster")
    cluster_tok_s = run.output_tokens_per_s
    share = control_plane_share(run, min_batch=1)
    record.control_plane_share = share["share"]
    record.notes["cluster"] = dict(output_tokens_per_s=cluster_tok_s, ratio_to_local=cluster_tok_s / local_tok_s,
                                   control_plane=share)
    print(f"cluster (Ray + gRPC): {cluster_tok_s:.1f} output tok/s = {cluster_tok_s / local_tok_s:.3f}x in-process; "
          f"control plane {share['share'] if share['share'] is not None else float('nan'):.1%} of a step", flush=True)


def _compare_hf(args, config, sample: Workload, ours: EngineRun, record: BenchRecord) -> None:
    from shardserve.bench.compare_hf import hf_dtype, run_hf

    dtype = hf_dtype(args.hf_dtype, config)
    hf = run_hf(config.model, sample, args.temperature, dtype, config.device, config.load_format,
                method=args.hf_method)
    ours_tok_s = ours.output_tokens_per_s
    record.ratio_vs_hf = ours_tok_s / hf.output_tokens_per_s
    record.notes["hf"] = dict(hf.as_notes(), dtype=dtype)
    record.notes["hf_sample"] = dict(num_prompts=len(sample.prompts), output_len=sample.output_lens[0],
                                     shardserve_output_tokens_per_s=ours_tok_s)
    print(f"transformers {hf.method} in {dtype}: {hf.output_tokens} tokens in {hf.elapsed_s:.2f} s = "
          f"{hf.output_tokens_per_s:.1f} output tok/s (whole call {hf.call_s:.2f} s)"
          + (f" [{hf.fallback_reason}]" if hf.fallback_reason else ""))
    print(f"same {len(sample.prompts)} prompts x {sample.output_lens[0]} tokens: shardserve {ours_tok_s:.1f} tok/s; "
          f"shardserve / transformers = {record.ratio_vs_hf:.2f}x", flush=True)
