"""`shardserve bench scaling`: how throughput scales with replicas x tensor parallelism on a Ray cluster.

For each configuration that fits (replicas x TP: 1x1, 2x1, 1x2, 4x1, 2x2, ... up to the cluster's GPUs, or its
CPUs with --device cpu; or --configs), `serve`'s own start_cluster runs it (--placement: each TP group on one node,
or spread) and, after a short untimed warm-up, two fixed workloads go through the gRPC API from --client-procs
load-generator processes (bench/scaling_client.py: one Python client caps near 25,000 tok/s):
- offline: --num-prompts random prompts, all submitted at once (greedy, ignore_eos), each answered in one message
  (final_only; --offline-stream: token by token): output tok/s;
- shared-prefix: --prefixes prefixes of --prefix-len tokens, --per-prefix requests each (a short unique tail), at
  --concurrency in flight: output tok/s, TTFT/TPOT p50/p99 and the prefix-cache hit rate (cached prompt tokens /
  prompt tokens, summed over the replicas). Before each such run the replicas' prefix caches are emptied
  (Controller.reset_caches); at > 1 replica it runs once per --routing policy, each replica keeping
  --shared-kv-blocks blocks when given (a working set larger than one replica's cache is where routing matters);
  one replica runs it with its whole cache and, when capped, with the cap.
Per run also: the control-plane share (1 - the workers' own step time / the engine steps' wall time, summed over
the replicas) and the client's CPU (its busiest process's share of a core: near 1.0 the client was the limit).
Speed-up is against 1x1 on the same workload and cap; efficiency divides it by the GPUs (ranks) used. Every
configuration's greedy tokens on the offline workload are compared with the first configuration's.

Output: a markdown table on stdout; --out-dir gets scaling.csv, scaling.md, scaling.png (matplotlib) and
scaling.json (one BenchRecord per run, benchmark "scaling"), rewritten after each configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import sys
import time

from shardserve.bench.record import BenchRecord, Stats
from shardserve.bench.scaling_report import write_outputs
from shardserve.launch.replica_actors import use_replica_hosts


def add_scaling_parser(kinds, add_engine_args, run) -> None:
    p = kinds.add_parser("scaling", help="throughput against replicas x TP on a Ray cluster (speed-up, efficiency)")
    add_engine_args(p)
    p.add_argument("--ray-address", default=None, help="the cluster to use (default: join this node's, else local)")
    p.add_argument("--configs", default=None, help="replicas x TP to run, e.g. 1x1,2x1,1x2 (default: all that fit)")
    p.add_argument("--max-units", type=int, default=None,
                   help="GPUs (CPU: ranks) to sweep up to (default: the cluster's GPUs; 2 on CPU)")
    p.add_argument("--routing", default="cache-aware", type=_policies,
                   help="routing policies (cache-aware, least-loaded, round-robin), comma-separated: the first "
                        "routes the offline run; the shared-prefix run goes once per policy at > 1 replica")
    p.add_argument("--num-prompts", type=int, default=64, help="offline workload: prompts")
    p.add_argument("--offline-stream", action="store_true",
                   help="offline workload: stream each answer token by token (default: final-only answers, one "
                        "message per request, as batch work reads them)")
    p.add_argument("--input-len", type=int, default=256, help="offline workload: prompt tokens each")
    p.add_argument("--output-len", type=int, default=128, help="offline workload: output tokens each")
    p.add_argument("--prefixes", type=int, default=16, help="shared-prefix workload: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix workload: tokens of each prefix")
    p.add_argument("--per-prefix", type=int, default=32, help="shared-prefix workload: requests per prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="shared-prefix workload: own tokens after the prefix")
    p.add_argument("--prefix-output-len", type=int, default=64, help="shared-prefix workload: output tokens each")
    p.add_argument("--concurrency", type=int, default=64, help="shared-prefix requests in flight")
    p.add_argument("--shared-configs", default=None,
                   help="configurations that also run the shared-prefix workload (default: all; none: offline only)")
    p.add_argument("--shared-kv-blocks", type=int, default=None,
                   help="KV blocks each replica keeps for the shared-prefix runs (default: all it has); below the "
                        "working set of the prefixes, so that routing decides the hit rate")
    p.add_argument("--placement", choices=["pack", "spread"], default="pack",
                   help="pack: each TP group on one node (STRICT_PACK); spread: a group may span nodes (SPREAD)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the server's --stream-interval: tokens a stream gathers per message after its first")
    p.add_argument("--replica-hosts", default="auto", choices=["auto", "process", "controller"],
                   help="the server's --replica-hosts: each replica's engine in a process of its own (process; auto: "
                        "at > 1 replica) or in the controller's (controller), for A/B runs")
    p.add_argument("--client-procs", type=int, default=4,
                   help="load-generator processes, each with its own gRPC channel (bench/scaling_client.py)")
    p.add_argument("--out-dir", default=None, help="write scaling.csv/.md/.png/.json here")
    p.set_defaults(func=run)


def _policies(text: str) -> str:
    for policy in text.split(","):
        if policy not in ("cache-aware", "least-loaded", "round-robin"):
            raise argparse.ArgumentTypeError(f"unknown routing policy {policy!r}: cache-aware, least-loaded, "
                                             "round-robin")
    return text


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


def _run_requests(pool, address: str, prompts: list[list[int]], max_tokens: int, concurrency: int, bar,
                  final_only: bool = False) -> dict:
    """Sends every prompt (greedy, ignore_eos) with `concurrency` in flight over the pool's client processes,
    streamed, or answered in one message each (final_only)."""
    r = pool.run(address, prompts, max_tokens, concurrency, on_done=bar.update, final_only=final_only)
    r["output_tok_s"] = sum(len(t) for t in r["tokens"]) / r["wall_s"]
    r["ttft"], r["tpot"] = _percentiles_ms(r.pop("ttft_s")), _percentiles_ms(r.pop("tpot_s"))
    return r


def _control_plane(before: list[dict], after: list[dict]) -> float | None:
    """1 - the workers' own time / the engine steps' wall time, summed over the replicas between two
    replica_stats calls (bench/control_plane.py's definition over every step, not only steady decode)."""
    step = sum(a["step_s"] - b["step_s"] for a, b in zip(after, before))
    forward = sum(a["forward_s"] - b["forward_s"] for a, b in zip(after, before))
    return 1.0 - forward / step if step > 0 and forward > 0 else None


def _workloads(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(args.seed)
    usable = range(100, min(vocab, 32000))
    offline = [[rng.choice(usable) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    prefixes = [[rng.choice(usable) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    shared = [prefixes[i % args.prefixes] + [rng.choice(usable) for _ in range(args.suffix_len)]
              for i in range(args.prefixes * args.per_prefix)]
    rng.shuffle(shared)
    return offline, shared


def _cache_counts(before: list[dict], after: list[dict]) -> dict:
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_prompt_tokens"] - b["cached_prompt_tokens"] for a, b in zip(after, before))
    return dict(cache_hit_rate=cached / prompt if prompt else 0.0,
                routed_per_replica=[a["routed"] - b["routed"] for a, b in zip(after, before)])


def run_config(config, replicas: int, args: argparse.Namespace, workloads, bar, pool, shared: bool) -> dict:
    """One configuration: start it, run the offline workload, then (shared) the shared-prefix one under each
    routing policy (one at one replica: they are the same there), the replicas' prefix caches reset and capped
    to --shared-kv-blocks before each; read the replicas' counters around every run; shut it down."""
    import ray

    from shardserve.launch.ray_serving import start_cluster

    offline, shared_prompts = workloads
    policies = args.routing.split(",")
    start = time.perf_counter()
    cluster = start_cluster(config, host="127.0.0.1", port=0, replicas=replicas, routing=policies[0],
                            strategy="SPREAD" if args.placement == "spread" else "STRICT_PACK",
                            stream_interval=args.stream_interval, replica_hosts=args.replica_hosts)
    runs = []
    try:
        started_s = time.perf_counter() - start
        # warm-up, not timed: kernels compile at their first shapes (a cache later configurations would find warm)
        pool.run(cluster.address, offline[:2 * replicas] + shared_prompts[:replicas], 4, 4 * replicas)
        before = ray.get(cluster.controller.replica_stats.remote())
        run = _run_requests(pool, cluster.address, offline, args.output_len, len(offline), bar,
                            final_only=not args.offline_stream)
        after = ray.get(cluster.controller.replica_stats.remote())
        runs.append(dict(run, workload="offline", routing=policies[0],
                         control_plane_share=_control_plane(before, after)))
        for policy, cap in _shared_runs(policies, replicas, args.shared_kv_blocks) if shared else ():
            usable = ray.get(cluster.controller.reset_caches.remote(policy, cap))
            before = ray.get(cluster.controller.replica_stats.remote())
            run = _run_requests(pool, cluster.address, shared_prompts, args.prefix_output_len, args.concurrency, bar)
            after = ray.get(cluster.controller.replica_stats.remote())
            runs.append(dict(run, workload="shared-prefix", routing=policy, kv_blocks_per_replica=usable, kv_cap=cap,
                             control_plane_share=_control_plane(before, after), **_cache_counts(before, after)))
    finally:
        cluster.shutdown(drain_timeout_s=0)
    for run in runs:
        pp = config.pipeline_parallel_size  # (-pp N: every replica N stages of tp ranks)
        run["config"], run["replicas"], run["tp"], run["start_s"] = \
            f"{replicas}x{config.tensor_parallel_size}" + (f" pp{pp}" if pp > 1 else ""), \
            replicas, config.tensor_parallel_size, started_s
    return runs


def _shared_runs(policies: list[str], replicas: int, cap: int | None) -> list[tuple[str, int | None]]:
    """(policy, KV cap) of each shared-prefix run: every policy at > 1 replica; one at one replica (they are the
    same there), with its whole cache too when capped (the hit rate of a replica that holds every prefix)."""
    if replicas > 1:
        return [(p, cap) for p in policies]
    return [(policies[0], None)] + ([(policies[0], cap)] if cap is not None else [])


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from tqdm import tqdm

    from shardserve.bench.scaling_client import ClientPool
    from shardserve.settings.resolve import build_engine_config, read_model_facts
    from shardserve.launch.placement import ensure_ray
    from shardserve.launch.server_process import resolve_ray_address

    base = build_engine_config(**engine_kwargs)
    ensure_ray(resolve_ray_address(args.ray_address))
    if args.configs:
        configs = [_parse_config(c) for c in args.configs.split(",")]
    else:
        import ray

        units = args.max_units or (int(ray.cluster_resources().get("GPU", 0)) if base.device == "cuda" else 2)
        configs = sweep(max(units // base.pipeline_parallel_size, 1), [1, 2, 4, 8])  # a replica: pp x tp units
    if args.shared_configs == "none":
        shared_at = set()
    else:
        shared_at = ({_parse_config(c) for c in args.shared_configs.split(",")} if args.shared_configs
                     else set(configs))
    policies = args.routing.split(",")
    workloads = _workloads(args, read_model_facts(base.model).vocab_size)
    total = sum(len(workloads[0]) + (len(workloads[1]) * len(_shared_runs(policies, r, args.shared_kv_blocks))
                                     if (r, tp) in shared_at else 0) for r, tp in configs)
    bar = tqdm(total=total, desc="scaling", unit="req", file=sys.stderr, dynamic_ncols=True)
    runs: list[dict] = []
    title = f"{args.model or 'default model'} on {base.device}"
    with ClientPool(args.client_procs) as pool:
        for replicas, tp in configs:
            bar.set_postfix_str(f"{replicas}x{tp}")
            config = dataclasses.replace(base, tensor_parallel_size=tp)
            runs += run_config(config, replicas, args, workloads, bar, pool, (replicas, tp) in shared_at)
            _compare(runs)
            if args.out_dir:  # after each configuration: a run cut short keeps what it measured
                write_outputs(runs, [_record(args, base, r) for r in runs], args.out_dir, title, quiet=True)
    bar.close()
    write_outputs(runs, [_record(args, base, r) for r in runs], args.out_dir, title)
    return 0 if all(r["outputs_match_first"] is not False for r in runs) else 1


def _compare(runs: list[dict]) -> None:
    """Greedy tokens against the first offline run; speed-up against 1x1 (else the first one-replica run, else
    itself) on the same workload and KV cap, efficiency = speed-up / (GPUs or ranks used / the reference's)."""
    reference = runs[0]["tokens"]
    for r in runs:
        r["outputs_match_first"] = r["tokens"] == reference if r["workload"] == "offline" else None
        r["outputs_match_fraction"] = (sum(a == b for a, b in zip(r["tokens"], reference)) / len(reference)
                                       if r["workload"] == "offline" else None)
        same = [x for x in runs if x["replicas"] == 1 and x["workload"] == r["workload"]
                and x.get("kv_cap") == r.get("kv_cap")]
        one = next((x for x in same if x["tp"] == 1), same[0] if same else r)
        r["speedup"] = r["output_tok_s"] / one["output_tok_s"]
        r["efficiency"] = r["speedup"] / (r["replicas"] * r["tp"] / (one["replicas"] * one["tp"]))


def _parse_config(text: str) -> tuple[int, int]:
    replicas, tp = (int(x) for x in text.lower().split("x"))
    return replicas, tp


def _record(args: argparse.Namespace, base, r: dict) -> dict:
    workload = (dict(kind="offline", num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len) if r["workload"] == "offline" else
                dict(kind="shared-prefix", prefixes=args.prefixes, prefix_len=args.prefix_len,
                     per_prefix=args.per_prefix, suffix_len=args.suffix_len, output_len=args.prefix_output_len,
                     max_concurrency=args.concurrency, kv_blocks_per_replica=r["kv_blocks_per_replica"]))
    workload["routing"] = r["routing"]
    if r["workload"] == "offline":
        workload["answers"] = "streamed" if args.offline_stream else "final-only"
    config = dataclasses.replace(base, tensor_parallel_size=r["tp"])
    record = BenchRecord.for_engine("scaling", args.model, config, workload=workload,
                                    output_tokens_per_s=r["output_tok_s"], speedup_vs_1=r["speedup"],
                                    ttft_ms=r["ttft"], tpot_ms=r["tpot"])
    record.replicas = r["replicas"]
    record.control_plane_share = r["control_plane_share"]
    if base.device == "cuda":
        record.num_gpus = r["replicas"] * r["tp"] * base.pipeline_parallel_size
    record.notes.update(efficiency=r["efficiency"], outputs_match_first=r["outputs_match_first"],
                        outputs_match_fraction=r["outputs_match_fraction"],
                        replica_hosts="process" if use_replica_hosts(args.replica_hosts, r["replicas"]) else "controller",
                        start_s=r["start_s"], wall_s=r["wall_s"], client_procs=r["client_procs"],
                        client_cpu_max=r["client_cpu_max"],
                        client_cpu_us_per_token=r["client_cpu_s"] / max(1, sum(len(t) for t in r["tokens"])) * 1e6)
    if r["workload"] == "shared-prefix":
        record.notes.update(cache_hit_rate=r["cache_hit_rate"], routed_per_replica=r["routed_per_replica"])
    if base.device == "cpu":  # how many cores the configuration had: the node's, shared by every rank placed there
        record.notes.update(cores_per_node=os.cpu_count(), **_cpu_shares(config, r["replicas"]))
    return dataclasses.asdict(record)


def _cpu_shares(config, replicas: int) -> dict:
    """The CPU ranks on a node and each one's threads (torch's and the native kernels' OpenMP), as the launcher
    sets them (shardserve/launch/placement.py: cpu_ranks_on_node)."""
    import ray

    from shardserve.launch.placement import cpu_ranks_on_node
    from shardserve.worker.distributed import cpu_threads_per_rank

    nodes = sum(1 for n in ray.nodes() if n["Alive"]) if ray.is_initialized() else 1
    ranks = cpu_ranks_on_node(config, replicas, nodes)
    return dict(nodes=nodes, ranks_per_node=ranks, threads_per_rank=cpu_threads_per_rank("cpu", ranks))
