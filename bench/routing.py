"""`shardserve bench routing`: what the global scheduler costs the controller, with replicas simulated.

Two measurements per replica count (default 8 and 64):
- router: the prompt's block hashes (its first ROUTE_BLOCKS) + Router.route (cluster/router.py), as the
  controller runs them per request,
  over a warm index (16 shared prefixes + unique tails, each replica holding some): CPU microseconds per request
  (thread_time, so other processes on a shared machine do not count) and the routed requests/s one core gives.
- controller: a real Controller (cluster/controller.py; gRPC server started, not used) whose replicas are real
  Engines over SimulatedExecutor, which takes a GPU-like step time (sleeps, releasing the GIL, as a step waiting on
  the workers does); closed-loop clients call add_request and read their streams. Reported: requests/s and output
  tok/s against the ideal (each replica stepping back to back), and the controller process's CPU (cores, from
  process_time over wall time) with the event loop's own share (thread_time on the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import deque
from dataclasses import dataclass

from shardserve.cluster.controller import Controller, ControllerConfig, ServedModel
from shardserve.cluster.engine import Engine
from shardserve.cluster.replica import ReplicaLoad
from shardserve.cluster.router import ROUTE_BLOCKS, Router, prompt_block_hashes
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult

VOCAB = 151936


class SimulatedExecutor:
    """Workers that compute nothing: each step takes base_ms + per_token_ms x batched tokens of wall time (a sleep)
    and every request that reaches the end of its known tokens "samples" token 1. submit/collect overlap like the
    real workers: a step's time starts when it is submitted, or when the previous one ends."""

    def __init__(self, num_kv_blocks: int, base_ms: float, per_token_ms: float) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.base_s, self.per_token_s = base_ms / 1e3, per_token_ms / 1e3
        self._known: dict[str, list[int]] = {}  # req id -> [computed, known tokens]
        self._pending: deque[tuple[float, StepResult]] = deque()
        self._free_at = 0.0
        self.num_steps = 0

    def submit(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self._known.pop(req_id, None)
        for new in plan.new_requests:
            self._known[new.req_id] = [new.num_computed_tokens, len(new.token_ids)]
        result = StepResult(step_id=plan.step_id)
        for req_id, n in zip(plan.req_ids, plan.num_tokens):
            state = self._known[req_id]
            state[0] += n
            if state[0] >= state[1]:
                state[1] += 1
                result.req_ids.append(req_id)
                result.token_ids.append(1)
                result.logprobs.append(None)
        step_s = self.base_s + self.per_token_s * sum(plan.num_tokens)
        self._free_at = max(self._free_at, time.perf_counter()) + step_s
        result.forward_ms = step_s * 1e3
        self._pending.append((self._free_at, result))
        self.num_steps += 1

    def collect(self) -> StepResult:
        ready_at, result = self._pending.popleft()
        delay = ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def shutdown(self) -> None:
        pass


@dataclass
class _StandIn:
    id: str
    load: ReplicaLoad
    serving: bool = True
    recovering: bool = False


def router_cost(num_replicas: int, prompt_len: int, num_requests: int, block_size: int = 16, seed: int = 0) -> dict:
    """Hash + route per request over a warm index: 16 shared prefixes of prompt_len/2 tokens, unique tails."""
    rng = random.Random(seed)
    stand_ins = [_StandIn(f"r{i}", ReplicaLoad(0, 0, 4096, 4096)) for i in range(num_replicas)]
    router = Router(stand_ins)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prompt_len // 2)] for _ in range(16)]
    prompts = [prefixes[i % 16] + [rng.randrange(VOCAB) for _ in range(prompt_len - prompt_len // 2)]
               for i in range(2048)]
    for p in prompts[:256]:  # warm: every prefix is held somewhere
        router.route(prompt_block_hashes(p, block_size, ROUTE_BLOCKS))
    # CPU time of this thread, not wall time: on a shared machine the wall clock also counts other processes' turns.
    start = time.thread_time()
    for k in range(num_requests):
        chosen, _ = router.route(prompt_block_hashes(prompts[k % len(prompts)], block_size, ROUTE_BLOCKS))
        stand_ins[chosen].load.outstanding_tokens = (stand_ins[chosen].load.outstanding_tokens + 7) % 50_000
    elapsed = time.thread_time() - start
    return dict(replicas=num_replicas, prompt_len=prompt_len, requests=num_requests,
                us_per_request=elapsed / num_requests * 1e6, routed_per_s=num_requests / elapsed,
                index_entries=router.index_size(), affinity=router.num_affinity / (num_requests + 256))


def controller_share(num_replicas: int, args: argparse.Namespace) -> dict:
    """A closed loop of `concurrency` requests per replica through a Controller with simulated replicas."""
    config = EngineConfig(model="simulated", device="cpu", block_size=16, max_model_len=4096,
                          max_num_seqs=args.concurrency, max_num_batched_tokens=2048, async_scheduling=True)

    def build(cfg: EngineConfig) -> Engine:
        return Engine(cfg, SimulatedExecutor(4096, args.base_ms, args.per_token_ms), vocab_size=VOCAB)

    controller_config = ControllerConfig(
        engine=config, model=ServedModel("simulated", "simulated", VOCAB, []), build_engine=build, port=0,
        num_replicas=num_replicas, max_live_requests=1 << 20, routing=args.routing,
    )
    rng = random.Random(0)
    prefixes = [[rng.randrange(VOCAB) for _ in range(args.input_len // 2)] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    async def run() -> dict:
        controller = Controller(controller_config)
        await controller.start()
        assert await controller.wait_ready(60)
        done = 0
        stop_at = time.perf_counter() + args.duration

        async def client(k: int) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                tail = [rng.randrange(VOCAB) for _ in range(args.input_len - len(prefixes[0]))]
                live = await controller.add_request(prefixes[k % 16] + tail, params)
                while not (await live.queue.get()).delta.finished:
                    pass
                done += 1

        cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(args.concurrency * num_replicas)))
        wall = time.perf_counter() - wall0
        cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
        steps = sum(r.engine.executor.num_steps for r in controller.replicas)
        await controller.shutdown(0)
        # The ideal: every replica steps back to back at its decode step time (the batch full of decodes).
        ideal_steps_per_s = num_replicas * 1e3 / (args.base_ms + args.per_token_ms * args.concurrency)
        return dict(replicas=num_replicas, requests=done, requests_per_s=done / wall,
                    output_tok_per_s=done * args.output_len / wall, steps_per_s=steps / wall,
                    ideal_steps_per_s=ideal_steps_per_s, step_efficiency=steps / wall / ideal_steps_per_s,
                    controller_cores=cpu / wall, event_loop_cores=loop_cpu / wall,
                    cpu_us_per_step=cpu / max(steps, 1) * 1e6, loop_cpu_us_per_request=loop_cpu / max(done, 1) * 1e6)

    return asyncio.run(run())


def main(args: argparse.Namespace, engine_kwargs: dict | None = None) -> int:
    results = []
    for m in (int(x) for x in args.replicas.split(",")):
        cost = router_cost(m, args.input_len, args.route_requests)
        print(f"router  replicas={m:3d}: {cost['us_per_request']:.1f} us/request (hash + route) = "
              f"{cost['routed_per_s']:,.0f} routed/s, {cost['index_entries']:,} index entries", flush=True)
        share = controller_share(m, args) if args.duration > 0 else {}
        if share:
            print(f"controller replicas={m:3d}: {share['requests_per_s']:,.0f} req/s, "
                  f"{share['output_tok_per_s']:,.0f} tok/s, steps {share['step_efficiency']:.0%} of ideal, "
                  f"controller CPU {share['controller_cores']:.2f} cores (event loop {share['event_loop_cores']:.2f}); "
                  f"{share['cpu_us_per_step']:.0f} us CPU per engine step, event loop "
                  f"{share['loop_cpu_us_per_request']:.0f} us per request",
                  flush=True)
        results.append(dict(router=cost, controller=share))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(command=vars(args) | {"func": None}, results=results), f, indent=2, default=str)
    return 0


def add_routing_parser(kinds) -> None:
    p = kinds.add_parser("routing", help="the global scheduler's cost with simulated replicas (no model, no GPU)")
    p.add_argument("--replicas", default="8,64", help="replica counts, comma-separated")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens of each simulated request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of each simulated request")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight per replica")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the controller run (0: router only)")
    p.add_argument("--route-requests", type=int, default=20000, help="requests routed in the router-only run")
    p.add_argument("--routing", default="cache-aware", choices=["cache-aware", "least-loaded", "round-robin"],
                   help="the routing policy measured")
    p.add_argument("--base-ms", type=float, default=6.0, help="simulated step time: fixed part")
    p.add_argument("--per-token-ms", type=float, default=0.004, help="simulated step time per batched token")
    p.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    p.set_defaults(func=lambda args: main(args))
