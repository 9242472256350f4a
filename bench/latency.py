"""`shardserve bench latency`: decode ms per token at a small batch (bs=1 by default), against the weight-read
bound: one rank's weights read once per token at the copy bandwidth measured in the same run.

ms/token is the median controller-side time of a decode step (engine.step(): everything a user waits for), after
the prefill step and a few warm-up steps; max_num_seqs is the batch size, so the CUDA graphs captured are the
ones this batch uses.
"""

from __future__ import annotations

import argparse

from shardserve.bench.harness import open_engine, run_workload, warm_up
from shardserve.bench.measure import free_device_memory, peak_memory_gb
from shardserve.bench.profile import profiled
from shardserve.bench.record import BenchRecord, Stats
from shardserve.bench.workload import grounded_workload, random_workload

SKIPPED_DECODE_STEPS = 3  # first decode steps: allocator and caches settling


def decode_rate(run, batch_size: int) -> float:
    """Tokens per second of the decode phase: every step after the one that completed the last prompt, less the
    first SKIPPED_DECODE_STEPS, its tokens over its controller-side time (one figure for runs with and without
    speculation, whose steps gain 1 to k + 1 tokens)."""
    first = next((i for i, n in enumerate(run.step_tokens) if n >= batch_size), 0) + 1 + SKIPPED_DECODE_STEPS
    ms, tokens = sum(run.step_ms[first:]), sum(run.step_tokens[first:])
    if not tokens:
        raise ValueError(f"no decode steps to time: raise --output-len above {SKIPPED_DECODE_STEPS + 1}")
    return tokens * 1e3 / ms


def speculation_summary(stats, speculative_config: str | None) -> dict | None:
    """The engine's speculative-decoding counters (None without speculation)."""
    if not speculative_config:
        return None
    return dict(num_drafts=stats.spec_num_drafts, num_draft_tokens=stats.spec_num_draft_tokens,
                num_accepted_tokens=stats.spec_num_accepted_tokens, acceptance_rate=stats.spec_acceptance_rate,
                mean_acceptance_length=stats.spec_mean_acceptance_length,
                accepted_per_pos=stats.spec_accepted_per_pos)


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.roofline import ModelShape, measure_rates, weight_read_bound_ms
    from shardserve.settings.resolve import build_engine_config, read_model_facts

    engine_kwargs = dict(engine_kwargs)
    if engine_kwargs.get("max_num_seqs") is None:
        engine_kwargs["max_num_seqs"] = args.batch_size
    config = build_engine_config(**engine_kwargs)
    vocab = read_model_facts(config.model).vocab_size
    rates = None if args.no_roofline else measure_rates(config.device)  # before the engine takes the memory
    bench = open_engine(config, "local")
    try:
        if getattr(args, "workload", "random") == "grounded":
            workload = grounded_workload(args.batch_size, args.output_len, bench.engine.tokenizer, vocab, seed=args.seed,
                                         passage_len=args.input_len)
        else:
            workload = random_workload(args.batch_size, (args.input_len, args.input_len),
                                       (args.output_len, args.output_len), vocab, seed=args.seed)
        warm_up(bench, vocab, batch=args.batch_size)
        with profiled(args.profile, config.device):
            run = run_workload(bench, workload, temperature=0.0, seed=args.seed)
        graphs, peak = bench.graphs, peak_memory_gb(config.device, config.tensor_parallel_size)
        speculation = speculation_summary(bench.engine.stats(), config.speculative_config)
    finally:
        bench.close()
        free_device_memory()
    decode = [ms for ms, _ in run.decode_steps(min_batch=args.batch_size)][SKIPPED_DECODE_STEPS:]
    rate = decode_rate(run, args.batch_size)
    if config.speculative_config:  # steps gain 1 to k + 1 tokens: time per token from the decode phase's totals
        decode = [1e3 / rate]
    if not decode:
        raise ValueError(f"no decode steps to time: raise --output-len above {SKIPPED_DECODE_STEPS + 1}")
    stats = Stats.of(decode)
    ms_per_step = stats.p50
    print(f"decode phase: {rate:.1f} tokens/s", flush=True)
    print(f"decode at batch {args.batch_size}: median {ms_per_step:.3f} ms per step over {len(decode)} steps "
          f"(tp {config.tensor_parallel_size}, pp {config.pipeline_parallel_size}, CUDA graphs: {graphs or 'see the worker logs'})", flush=True)
    record = BenchRecord.for_engine(
        "latency", args.model, config,
        workload=dict(num_prompts=args.batch_size, input_len=workload.num_prompt_tokens // args.batch_size,
                      output_len=args.output_len, concurrency=args.batch_size,
                      kind=getattr(args, "workload", "random")),
        ms_per_token=ms_per_step, tpot_ms=stats, peak_memory_gb=peak,
        output_tokens_per_s=args.batch_size * 1e3 / ms_per_step,
    )
    record.notes.update(cuda_graphs=graphs, decode_steps_timed=len(decode), enforce_eager=config.enforce_eager,
                        mean_ms=sum(decode) / len(decode), decode_tokens_per_s=rate,
                        speculative_config=config.speculative_config, speculation=speculation)
    if rates is not None:
        shape = ModelShape.of_engine(config)
        bound = weight_read_bound_ms(shape, rates)
        record.notes.update(weight_read_bound_ms=bound, weight_bytes_per_rank=shape.decode_weight_bytes,
                            rates=rates.__dict__, bound_fraction=bound / ms_per_step)
        print(f"weight-read bound: {shape.decode_weight_bytes / 1e9:.3f} GB per rank / "
              f"{rates.copy_bytes_per_s / 1e12:.2f} TB/s = {bound:.3f} ms; measured {ms_per_step:.3f} ms "
              f"= {ms_per_step / bound:.2f}x the bound", flush=True)
    record.write(args.json_out)
    return 0
