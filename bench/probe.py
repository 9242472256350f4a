"""`shardserve bench probe`: where one engine step's time goes, on one device (TP=1), part by part.

For each batch size B it builds B requests with a context of --context-len tokens already "in the cache" (the
cache holds whatever it holds: timing only) and runs decode steps straight on a ModelRunner, then times:
  step       a whole decode step, launch + finish, waited for (what a step costs without overlap)
  launch     host time of launch_step alone (plan -> inputs -> forward/graph launch -> sampling launch)
  forward    the model forward on the device (a graph replay where a graph covers B; CUDA events)
  lm_head    compute_logits on B rows (CUDA events)
  sample     sample_tokens on B rows at --temperature (CUDA events), greedy, and with top_p 0.9
and, under the torch profiler over a few steps, the device time per step, the kernels per step and the top
kernels. Then one prefill step of --prefill-tokens tokens (eager), timed and profiled the same way.
The numbers say which part to attack: host (launch > device), forward kernels, LM head, sampling or prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, cdiv


def _events_ms(fn, repeats: int) -> float:
    """Median device time of fn over repeats, CUDA events (after one warm-up); wall time on CPU."""
    from shardserve.bench.roofline import time_ms

    return time_ms(fn, torch.device("cuda" if torch.cuda.is_available() else "cpu"), repeats)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _activities():
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _kernel_table(prof, steps: int, rows: int = 12) -> dict:
    """Device time and launches per step from a profile, and the top kernels by device time."""
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    if not kernels:  # CPU: the top operators by self CPU time instead
        kernels = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        for e in kernels:
            e.self_device_time_total = e.self_cpu_time_total
    total_us = sum(e.self_device_time_total for e in kernels)
    count = sum(e.count for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]
    return {
        "device_ms_per_step": total_us / 1e3 / steps,
        "kernels_per_step": count / steps,
        "top": [{"kernel": e.key[:90], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                 "launches_per_step": e.count / steps} for e in top],
    }


def _decode_steps(repeats: int) -> int:
    """Decode steps probe_decode runs on one batch (timed, warm-up and profiled ones), with room to spare."""
    return 3 * repeats + 20


def _blocks_each(tokens: int, block_size: int) -> int:
    return cdiv(tokens + 8, block_size)


def _finish(runner, req_ids: list[str]) -> None:
    runner.execute(StepPlan(step_id=runner.last_step_id + 1, finished_req_ids=list(req_ids)))


class _Batch:
    """B synthetic requests on a runner, stepped one decode token at a time."""

    def __init__(self, runner, batch: int, context: int, steps: int, temperature: float, vocab: int) -> None:
        self.runner = runner
        blocks_each = _blocks_each(context + steps, runner.block_size)
        gen = torch.Generator().manual_seed(batch)
        self.req_ids = [f"probe-{batch}-{i}" for i in range(batch)]
        new = []
        for i, req_id in enumerate(self.req_ids):
            ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
            blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
            new.append(NewRequest(req_id, ids, context - 1, context - 1, blocks,
                                  SamplingSpec(temperature=temperature, seed=i)))
        self.prompt = list(new[0].token_ids) if new else []  # the first request's prompt
        self.pending_new = new

    def plan(self) -> StepPlan:
        runner = self.runner
        plan = StepPlan(step_id=runner.last_step_id + 1, new_requests=self.pending_new, req_ids=self.req_ids,
                        num_tokens=[1] * len(self.req_ids))
        self.pending_new = []
        return plan


def probe_decode(runner, batch: int, context: int, temperature: float, vocab: int, repeats: int) -> dict:
    from torch.profiler import profile

    from shardserve.worker.cuda_graphs import padded_batch_size
    from shardserve.worker.sampler import sample_tokens
    from shardserve.worker.sampling_row import SamplingRow

    b = _Batch(runner, batch, context, _decode_steps(repeats), temperature, vocab)
    out: dict = {"batch": batch, "context": context, "temperature": temperature}
    step_ms, launch_ms = [], []
    with torch.inference_mode():
        for i in range(repeats + 3):
            _sync()
            t0 = time.perf_counter()
            flight = runner.launch_step(b.plan())
            t1 = time.perf_counter()
            runner.finish_step(flight)
            t2 = time.perf_counter()
            if i >= 3:
                step_ms.append((t2 - t0) * 1e3)
                launch_ms.append((t1 - t0) * 1e3)
        out["step_ms"] = statistics.median(step_ms)
        out["launch_host_ms"] = statistics.median(launch_ms)
        graphs = runner.decode_graphs
        padded = padded_batch_size(batch, graphs.batch_sizes) if graphs is not None else None
        if padded is not None and graphs.use_cuda_graphs:
            (graph, _), = graphs.probe(padded, copies=1)  # a graph like the one serving this batch, kept here
            out["forward_ms"] = _events_ms(graph.replay, repeats)
            out["forward"] = f"graph of {padded}"
        hidden = torch.randn(batch, runner.hf_config.hidden_size, device=runner.device, dtype=runner.dtype)
        out["lm_head_ms"] = _events_ms(lambda: runner.model.compute_logits(hidden), repeats)
        logits = runner.model.compute_logits(hidden)
        tokens = b.prompt  # what a row's tokens are only matters to penalties, which these specs leave off
        rows = [SamplingRow(SamplingSpec(temperature=temperature, seed=i), tokens, 1) for i in range(batch)]
        out["sample_ms"] = _events_ms(lambda: sample_tokens(logits, rows), repeats)
        greedy = [SamplingRow(SamplingSpec(temperature=0.0), tokens, 1)] * batch
        out["sample_greedy_ms"] = _events_ms(lambda: sample_tokens(logits, greedy), repeats)
        nucleus = [SamplingRow(SamplingSpec(temperature=temperature, top_p=0.9, seed=i), tokens, 1)
                   for i in range(batch)]
        out["sample_top_p_ms"] = _events_ms(lambda: sample_tokens(logits, nucleus), repeats)
        profiled_steps = 5
        with profile(activities=_activities()) as prof:
            for _ in range(profiled_steps):
                runner.execute(b.plan())
            _sync()
        out["profile"] = _kernel_table(prof, profiled_steps)
        _finish(runner, b.req_ids)
    return out


def probe_prefill(runner, tokens: int, seq_len: int, vocab: int, repeats: int) -> dict:
    from torch.profiler import profile

    n = max(1, tokens // seq_len)
    blocks_each = _blocks_each(seq_len, runner.block_size)
    out: dict = {"tokens": n * seq_len, "seq_len": seq_len}
    times = []
    with torch.inference_mode():
        for r in range(repeats + 2):
            ids = [f"prefill-{r}-{i}" for i in range(n)]
            new = [NewRequest(req_id, [(7 * i + j) % vocab for j in range(seq_len)], seq_len, 0,
                              list(range(i * blocks_each, (i + 1) * blocks_each)),
                              SamplingSpec(temperature=0.6, seed=i))
                   for i, req_id in enumerate(ids)]
            plan = StepPlan(step_id=runner.last_step_id + 1, new_requests=new, req_ids=ids, num_tokens=[seq_len] * n)
            _sync()
            t0 = time.perf_counter()
            if r == repeats + 1:
                with profile(activities=_activities()) as prof:
                    runner.execute(plan)
                    _sync()
                out["profile"] = _kernel_table(prof, 1)
            else:
                runner.execute(plan)
                if r >= 1:
                    times.append((time.perf_counter() - t0) * 1e3)
            _finish(runner, ids)
    out["step_ms"] = statistics.median(times)
    out["tokens_per_s"] = out["tokens"] / out["step_ms"] * 1e3
    return out


def _print_part(result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    profile = result["profile"]
    print(f"  device ms/step {profile['device_ms_per_step']:.3f}, kernels/step {profile['kernels_per_step']:.0f}")
    for row in profile["top"]:
        print(f"    {row['ms_per_step']:8.3f} ms {row['launches_per_step']:6.1f}x  {row['kernel']}")


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.attention_rates import split_specs
    from shardserve.settings.resolve import build_engine_config, read_model_facts
    from shardserve.worker.model_runner import ModelRunner

    rate_shapes, rate_spread = split_specs(args.attention_rates)  # a malformed spec fails now, not after the probe
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine_kwargs = dict(engine_kwargs)
    engine_kwargs["max_num_seqs"] = max(batches)
    bs = engine_kwargs.get("block_size") or 16
    need = max(batches) * _blocks_each(args.context_len + _decode_steps(args.repeats), bs)
    need = max(need, (args.prefill_tokens // args.prefill_seq_len + 1) * _blocks_each(args.prefill_seq_len, bs))
    engine_kwargs["num_kv_blocks"] = engine_kwargs.get("num_kv_blocks") or need
    config = build_engine_config(**engine_kwargs)
    if config.tensor_parallel_size != 1:
        raise SystemExit("bench probe runs on one device (--tp 1)")
    vocab = read_model_facts(config.model).vocab_size
    runner = ModelRunner(config)
    runner.allocate_kv_cache(config.num_kv_blocks)
    report = {"model": args.model, "config": {"max_num_seqs": config.max_num_seqs, "dtype": config.dtype,
                                              "kv_cache_dtype": config.kv_cache_dtype},
              "decode": [], "prefill": None}
    for batch in batches:
        result = probe_decode(runner, batch, args.context_len, args.temperature, vocab, args.repeats)
        report["decode"].append(result)
        _print_part(result)
    if args.prefill_tokens:
        result = probe_prefill(runner, args.prefill_tokens, args.prefill_seq_len, vocab, args.repeats // 3 + 1)
        report["prefill"] = result
        _print_part(result)
    if args.sweep_attention:
        report["attention_sweep"] = []
        for spec in args.sweep_attention.split(","):  # BATCHxCONTEXT
            batch, context = (int(x) for x in spec.split("x"))
            try:
                rows, chosen = sweep_decode_attention(args.model, batch, context)
            except Exception as exc:  # the probe's other numbers still count
                print(f"decode attention sweep {spec} failed: {exc!r}", flush=True)
                continue
            best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
            default = next((r for r in rows if r.get("block_n") == 64 and r.get("warps") == 4
                            and r.get("stages") == 2 and r.get("splits") == chosen and "ms" in r), None)
            report["attention_sweep"].append({"batch": batch, "context": context, "chosen_splits": chosen,
                                              "default": default, "best": best, "all": rows})
            print(f"decode attention {batch}x{context}: default {default} | best {best}", flush=True)
    if args.attention_rates:  # BATCHxCONTEXT or BATCHxLOW-HIGH,...: each attention kernel's bytes/s, bf16 and FP8
        from shardserve.bench.attention_rates import attention_rates, ragged
        from shardserve.bench.roofline import measure_rates

        rates = measure_rates("cuda", matmul_n=1024)
        report["attention_rates"] = {"copy_bytes_per_s": rates.copy_bytes_per_s,
                                     "rows": attention_rates(args.model, rate_shapes, rates.copy_bytes_per_s),
                                     "ragged": ragged(args.model, rate_spread, rates.copy_bytes_per_s)}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def sweep_decode_attention(model: str, batch: int, context: int, repeats: int = 20) -> tuple[list[dict], int]:
    """Times the paged decode kernel over its launch settings (BLOCK_N, warps, stages, splits) on the model's
    per-rank attention shape, bf16, a random cache of batch x context tokens: the KV bytes read over the time."""
    from transformers import AutoConfig

    from shardserve.bench.attention_cases import graph_ms
    from shardserve.kernels.paged_decode import choose_num_splits, paged_decode_attention
    from shardserve.settings.model_source import resolve_model

    hf = AutoConfig.from_pretrained(resolve_model(model, "dummy").model_dir)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    bs = 16
    blocks_each = cdiv(context, bs)
    device = torch.device("cuda")
    k_cache = torch.randn(batch * blocks_each, bs, kv_heads, dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_each, device=device).view(batch, blocks_each).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=device)
    kv_bytes = batch * context * kv_heads * dim * 2 * 2
    chosen = choose_num_splits(batch, kv_heads, context)
    results = []
    settings = [(splits, block_n, warps, stages)
                for splits in sorted({chosen, 2 * chosen, 4 * chosen} | ({1} if chosen <= 2 else set()))
                for block_n in (32, 64) for warps in (4, 8) for stages in (2, 3)]
    for num_splits, block_n, warps, stages in settings:
        def run():
            paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, num_splits=num_splits,
                                   block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            ms = graph_ms([run])  # CUDA-graph replay: no host launch time in the figure
        except Exception as exc:  # a setting this GPU cannot compile (shared memory): skipped
            results.append({"splits": num_splits, "block_n": block_n, "warps": warps, "stages": stages,
                            "error": type(exc).__name__})
            continue
        results.append({"splits": num_splits, "block_n": block_n, "warps": warps, "stages": stages,
                        "ms": ms, "tb_per_s": kv_bytes / ms / 1e9})
    return results, chosen
