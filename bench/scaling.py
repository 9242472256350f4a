"""`shardserve bench scaling`: how throughput scales with replicas x tensor parallelism on a Ray cluster.

For each configuration that fits (replicas x TP: 1x1, 2x1, 1x2, 4x1, 2x2, ... up to the cluster's GPUs, or its
CPUs with --device cpu; or --configs), `serve`'s own start_cluster runs it and two fixed workloads go through the
gRPC client:
- offline: --num-prompts random prompts, all submitted at once (greedy, ignore_eos): output tok/s;
- shared-prefix: --prefixes prefixes of --prefix-len tokens, --per-prefix requests each (a short unique tail), at
  --concurrency in flight: output tok/s, TTFT/TPOT p50/p99 and the prefix-cache hit rate (cached prompt tokens /
  prompt tokens, summed over the replicas).
Speed-up and efficiency are against one replica of the same TP (1x1 when that was not run). Every configuration's
greedy tokens on the offline workload are compared with the first configuration's.

Output: a markdown table on stdout; --out-dir gets scaling.csv, scaling.md, scaling.png (matplotlib) and
scaling.json (one BenchRecord per configuration and workload, benchmark "scaling").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time

from shardserve.bench.record import BenchRecord, Stats
from shardserve.bench.scaling_report import write_outputs


def add_scaling_parser(kinds, add_engine_args, run) -> None:
    p = kinds.add_parser("scaling", help="throughput against replicas x TP on a Ray cluster (speed-up, efficiency)")
    add_engine_args(p)
    p.add_argument("--ray-address", default=None, help="the cluster to use (default: join this node's, else local)")
    p.add_argument("--configs", default=None, help="replicas x TP to run, e.g. 1x1,2x1,1x2 (default: all that fit)")
    p.add_argument("--max-units", type=int, default=None,
                   help="GPUs (CPU: ranks) to sweep up to (default: the cluster's GPUs; 2 on CPU)")
    p.add_argument("--routing", default="cache-aware", choices=["cache-aware", "least-loaded", "round-robin"],
                   help="the routing policy of every configuration")
    p.add_argument("--num-prompts", type=int, default=64, help="offline workload: prompts")
    p.add_argument("--input-len", type=int, default=256, help="offline workload: prompt tokens each")
    p.add_argument("--output-len", type=int, default=128, help="offline workload: output tokens each")
    p.add_argument("--prefixes", type=int, default=16, help="shared-prefix workload: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix workload: tokens of each prefix")
    p.add_argument("--per-prefix", type=int, default=32, help="shared-prefix workload: requests per prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="shared-prefix workload: own tokens after the prefix")
    p.add_argument("--prefix-output-len", type=int, default=64, help="shared-prefix workload: output tokens each")
    p.add_argument("--concurrency", type=int, default=64, help="shared-prefix requests in flight")
    p.add_argument("--out-dir", default=None, help="write scaling.csv/.md/.png/.json here")
    p.set_defaults(func=run)


def sweep(max_units: int, tps: list[int]) -> list[tuple[int, int]]:
    """(replicas, tp) pairs with replicas * tp <= max_units and both powers of two: 1x1, 2x1, 1x2, 4x1, 2x2, ..."""
    configs = []
    units = 1
    while units <= max_units:
        for tp in sorted(tps):
            if units % tp == 0:
                configs.append((units // tp, tp))
        units *= 2
    return configs


def _percentiles_ms(values: list[float]) -> Stats | None:
    return Stats.of([v * 1e3 for v in values])


async def _run_requests(address: str, prompts: list[list[int]], max_tokens: int, concurrency: int, bar) -> dict:
    """Streams every prompt (greedy, ignore_eos) with `concurrency` in flight; timings and tokens per request."""
    from shardserve.client import AsyncClient

    ttft, tpot, tokens = [], [], [None] * len(prompts)
    slots = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout=3600) as client:
        async def one(i: int) -> None:
            async with slots:
                start = time.perf_counter()
                first = None
                stream = client.stream(prompts[i], temperature=0, max_tokens=max_tokens, ignore_eos=True)
                async for delta in stream:
                    if delta.token_ids and first is None:
                        first = time.perf_counter()
                end = time.perf_counter()
                tokens[i] = stream.result.token_ids
                if first is not None:
                    ttft.append(first - start)
                    if len(tokens[i]) > 1:
                        tpot.append((end - first) / (len(tokens[i]) - 1))
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    return dict(wall_s=wall, tokens=tokens, output_tok_s=sum(len(t) for t in tokens) / wall,
                ttft=_percentiles_ms(ttft), tpot=_percentiles_ms(tpot))


def _workloads(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(args.seed)
    usable = range(100, min(vocab, 32000))
    offline = [[rng.choice(usable) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    prefixes = [[rng.choice(usable) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    shared = [prefixes[i % args.prefixes] + [rng.choice(usable) for _ in range(args.suffix_len)]
              for i in range(args.prefixes * args.per_prefix)]
    rng.shuffle(shared)
    return offline, shared


def run_config(config, replicas: int, args: argparse.Namespace, workloads, bar) -> dict:
    """One configuration: start it, run both workloads, read the replicas' cache counters, shut it down."""
    import ray

    from shardserve.ray_cluster import start_cluster

    offline, shared = workloads
    start = time.perf_counter()
    cluster = start_cluster(config, host="127.0.0.1", port=0, replicas=replicas, routing=args.routing)
    try:
        started_s = time.perf_counter() - start
        off = asyncio.run(_run_requests(cluster.address, offline, args.output_len, len(offline), bar))
        before = ray.get(cluster.controller.replica_stats.remote())
        pre = asyncio.run(_run_requests(cluster.address, shared, args.prefix_output_len, args.concurrency, bar))
        after = ray.get(cluster.controller.replica_stats.remote())
    finally:
        cluster.shutdown(drain_timeout_s=0)
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_prompt_tokens"] - b["cached_prompt_tokens"] for a, b in zip(after, before))
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    return dict(replicas=replicas, tp=config.tensor_parallel_size, start_s=started_s, offline=off, shared=pre,
                cache_hit_rate=cached / prompt if prompt else 0.0, shared_routed=routed)


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from tqdm import tqdm

    from shardserve.config import build_engine_config, read_model_facts
    from shardserve.launcher import ensure_ray
    from shardserve.ray_cluster import resolve_ray_address

    base = build_engine_config(**engine_kwargs)
    ensure_ray(resolve_ray_address(args.ray_address))
    if args.configs:
        configs = [tuple(int(x) for x in c.lower().split("x")) for c in args.configs.split(",")]
    else:
        import ray

        units = args.max_units or (int(ray.cluster_resources().get("GPU", 0)) if base.device == "cuda" else 2)
        configs = sweep(max(units, 1), [1, 2, 4, 8])
    workloads = _workloads(args, read_model_facts(base.model).vocab_size)
    total = len(configs) * (len(workloads[0]) + len(workloads[1]))
    bar = tqdm(total=total, desc="scaling", unit="req", file=sys.stderr, dynamic_ncols=True)
    results = []
    for replicas, tp in configs:
        bar.set_postfix_str(f"{replicas}x{tp}")
        config = dataclasses.replace(base, tensor_parallel_size=tp)
        results.append(run_config(config, replicas, args, workloads, bar))
    bar.close()
    reference = results[0]["offline"]["tokens"]
    for r in results:
        r["outputs_match_first"] = r["offline"]["tokens"] == reference
        one = next((x for x in results if x["replicas"] == 1 and x["tp"] == r["tp"]),
                   next((x for x in results if x["replicas"] == 1 and x["tp"] == 1), results[0]))
        for kind in ("offline", "shared"):
            r[kind]["speedup"] = r[kind]["output_tok_s"] / one[kind]["output_tok_s"]
            r[kind]["efficiency"] = r[kind]["speedup"] / (r["replicas"] * r["tp"] / (one["replicas"] * one["tp"]))
    records = [_record(args, base, r, kind) for r in results for kind in ("offline", "shared")]
    write_outputs(results, records, args.out_dir, title=f"{args.model or 'default model'} on {base.device}")
    return 0 if all(r["outputs_match_first"] for r in results) else 1


def _record(args: argparse.Namespace, base, r: dict, kind: str) -> dict:
    w = r[kind]
    workload = (dict(kind="offline", num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len) if kind == "offline" else
                dict(kind="shared-prefix", prefixes=args.prefixes, prefix_len=args.prefix_len,
                     per_prefix=args.per_prefix, suffix_len=args.suffix_len, output_len=args.prefix_output_len,
                     max_concurrency=args.concurrency, routing=args.routing))
    config = dataclasses.replace(base, tensor_parallel_size=r["tp"])
    record = BenchRecord.for_engine("scaling", args.model, config, workload=workload,
                                    output_tokens_per_s=w["output_tok_s"], speedup_vs_1=w["speedup"],
                                    ttft_ms=w["ttft"], tpot_ms=w["tpot"])
    record.replicas = r["replicas"]
    if base.device == "cuda":
        record.num_gpus = r["replicas"] * r["tp"]
    record.notes.update(efficiency=w["efficiency"], outputs_match_first=r["outputs_match_first"],
                        start_s=r["start_s"])
    if kind == "shared":
        record.notes.update(cache_hit_rate=r["cache_hit_rate"], routed_per_replica=r["shared_routed"])
    return dataclasses.asdict(record)
