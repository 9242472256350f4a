"""The serving tier's CPU per streamed token and per request, with the GPU taken out:

    python -m shardserve.bench.stream_cost --replicas 2 --stream-intervals 1,4,8,final
    python -m shardserve.bench.stream_cost --replica-hosts front --fronts 2 --stream-intervals 1,final

A real Controller (gRPC server on 127.0.0.1) whose replicas are Engines over bench/routing.py's SimulatedExecutor
(a decode step takes --step-ms of wall time, computes nothing), read by bench/scaling_client.py's client processes
(other processes: their CPU does not count). With --replica-hosts process each replica's engine runs in a Ray actor
of its own (shardserve/launch/replica_actors.py; a local Ray is started), so the controller's CPU is routing, streaming and
the hosts' reports only. Per --stream-interval (or "final": final_only requests, answered in one message each):
output tok/s, the controller process's CPU per output token (all its threads: engine loops, event loop, gRPC) and
the event loop thread's own part. One process
caps at about 1 / (CPU per token) tokens/s: the ceiling the two-GPU scaling runs met (docs/performance-history.md).
With --replica-hosts front the client API is served by --fronts front processes (Ray actors, cluster/front_process.py)
that stream straight from the hosts: then the front processes' CPU (psutil, all their threads) is the tier's, per
output token and per request, and the controller's own CPU is reported beside it (it handles no token).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
import uuid

from shardserve.bench.routing import VOCAB, SimulatedExecutor
from shardserve.bench.scaling_client import ClientPool
from shardserve.cluster.controller import Controller, ControllerConfig, ServedModel
from shardserve.cluster.engine import Engine
from shardserve.proto.config import EngineConfig


@dataclasses.dataclass
class SimulatedEngine:
    """An Engine over a SimulatedExecutor (picklable: a replica host builds it in its own process)."""

    step_ms: float

    def __call__(self, cfg: EngineConfig) -> Engine:
        return Engine(cfg, SimulatedExecutor(8192, self.step_ms, 0.0), vocab_size=VOCAB)


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def measure(base: ControllerConfig, interval: str, pool: ClientPool, prompts: list[list[int]], output_len: int) -> dict:
    """interval: tokens per stream message, or "final": final_only requests (one message each)."""
    final_only = interval == "final"

    async def run() -> dict:
        controller = Controller(dataclasses.replace(base, stream_interval=1 if final_only else int(interval)))
        address = await controller.start()
        try:
            assert await controller.wait_ready(60)
            fronts = [s["pid"] for s in await controller.front_statuses() if s is not None]
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, pool.run, address, prompts[:8], 4, 8)  # warm-up
            cpu0, loop0, fronts0 = time.process_time(), time.thread_time(), _cpu_s(fronts)
            r = await loop.run_in_executor(None, lambda: pool.run(address, prompts, output_len, len(prompts),
                                                                  final_only=final_only))
            cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
            front_cpu = _cpu_s(fronts) - fronts0
        finally:
            await controller.shutdown(0)
        tokens = sum(len(t) for t in r["tokens"])
        tier = front_cpu if fronts else cpu  # the process(es) serving the client API
        return dict(stream_interval=interval, fronts=len(fronts), output_tok_s=tokens / r["wall_s"],
                    requests=len(prompts), tokens=tokens, tier_cpu_us_per_token=tier / tokens * 1e6,
                    tier_cpu_us_per_request=tier / len(prompts) * 1e6, tier_cores=tier / r["wall_s"],
                    controller_cpu_s=cpu, cpu_us_per_token=cpu / tokens * 1e6,
                    loop_cpu_us_per_token=loop_cpu / tokens * 1e6, controller_cores=cpu / r["wall_s"],
                    client_cpu_max=r["client_cpu_max"])

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description="the controller's CPU per streamed token (simulated replicas)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--stream-intervals", default="1,4,8,final",
                        help="tokens per stream message to try; final: final_only requests, one message each")
    parser.add_argument("--step-ms", type=float, default=5.0, help="simulated step time (Qwen3-0.6B, batch 128: ~5)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--replica-hosts", choices=["controller", "process", "front"], default="controller",
                        help="the replicas' engines in the controller process, or each in a Ray actor of its own "
                        "(process: the controller streams; front: --fronts front processes stream)")
    parser.add_argument("--fronts", type=int, default=1, help="front processes (--replica-hosts front)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    engine = EngineConfig(model="simulated", device="cpu", block_size=16, max_model_len=4096, max_num_seqs=128,
                          max_num_batched_tokens=8192, async_scheduling=True)
    base = ControllerConfig(
        engine=engine, model=ServedModel("simulated", "simulated", VOCAB, []), port=0,
        build_engine=SimulatedEngine(args.step_ms), name=f"stream-cost-{uuid.uuid4().hex[:6]}",
        num_replicas=args.replicas, max_live_requests=1 << 20, routing="round-robin")
    if args.replica_hosts in ("process", "front"):
        from shardserve.launch.front_actors import RayFronts
        from shardserve.launch.local_ray import init_local_ray
        from shardserve.launch.replica_actors import RayReplicaHosts

        init_local_ray(4, log_to_driver=False)
        base.replica_hosts = RayReplicaHosts(base.name, "cpu")
        if args.replica_hosts == "front":
            base.fronts = RayFronts(base.name, None, args.fronts)
    results = []
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    with ClientPool(args.client_procs) as pool:
        for interval in args.stream_intervals.split(","):
            m = measure(base, interval, pool, prompts, args.output_len)
            results.append(m)
            print(f"stream interval {interval}: {m['output_tok_s']:,.0f} tok/s; serving tier ({m['fronts'] or 'the controller'}"
                  f"{' fronts' if m['fronts'] else ''}) {m['tier_cpu_us_per_token']:.1f} us CPU per token, "
                  f"{m['tier_cpu_us_per_request']:.0f} us per request, {m['tier_cores']:.2f} cores; controller "
                  f"{m['cpu_us_per_token']:.1f} us per token ({m['controller_cores']:.2f} cores); "
                  f"busiest client process {m['client_cpu_max']:.0%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="stream_cost", args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
