"""The soak's requests in flight: `--concurrency` clients send the schedule, a killer SIGKILLs a worker rank at
evenly spread points and watches health go NOT_SERVING and back, a sampler reads memory every few seconds.

Every request ends in one outcome, checked against what is right for its kind (bench/soak_requests.py):
- a valid stream must finish (clients resume, so a restarted group or controller is a pause); greedy and seeded
  ones (and the stop-string ones) must give exactly the pool's undisturbed tokens; unseeded ones, max_tokens tokens;
- an invalid request must get its status; a cancelled stream ends when left; a deadline ends in a result or
  DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from shardserve.bench.soak_procs import memory_sample, worker_pids
from shardserve.bench.soak_requests import EXPECTED, Limits, Spec, send_invalid

CHECKED = ("greedy", "seeded", "stop")
MAX_EXAMPLES = 20  # problems kept verbatim in the record (all are counted)


@dataclass
class SoakState:
    outcomes: Counter = field(default_factory=Counter)  # "kind outcome" -> count
    problems: Counter = field(default_factory=Counter)  # "lost" / "wrong-code" / "mismatch" -> count
    examples: list = field(default_factory=list)
    resumes: int = 0
    completed: int = 0
    kills: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def problem(self, what: str, detail: dict) -> None:
        self.problems[what] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"problem": what, **detail})


async def stream_tokens(client, spec: Spec, timeout_s: float, resume_timeout_s: float) -> tuple[object, int]:
    """Runs one valid stream to its end, resuming when it breaks: (its GenerationResult, how many resumes)."""
    stream = client.stream(spec.prompt, max_tokens=spec.max_tokens, timeout=timeout_s, resume=True,
                           resume_timeout_s=resume_timeout_s, **spec.sampling)
    async for _ in stream:
        pass
    return stream.result, stream.num_resumes


async def reference_tokens(client, pool: dict[str, list[Spec]], concurrency: int, timeout_s: float) -> dict:
    """(kind, index) -> token ids of every checked pool stream, run once before anything is disturbed."""
    keys = [(kind, i) for kind in CHECKED for i in range(len(pool[kind]))]
    gate = asyncio.Semaphore(concurrency)

    async def one(kind: str, i: int) -> list[int]:
        async with gate:
            result, _ = await stream_tokens(client, pool[kind][i], timeout_s, 0.0)
            return list(result.token_ids)

    tokens = await asyncio.gather(*(one(kind, i) for kind, i in keys))
    return dict(zip(keys, tokens))


async def _one(kind: str, j: int, client, channel, pool, reference, limits: Limits, args, state: SoakState) -> None:
    outcome = "ok"
    if kind in EXPECTED:
        outcome = await send_invalid(channel, kind, limits, client)
        if outcome != EXPECTED[kind]:
            state.problem("wrong-code", {"kind": kind, "got": outcome, "expected": EXPECTED[kind]})
    elif kind == "cancel":
        spec, leave_after = pool["greedy"][j], 1 + j % 3
        stream = client.stream(spec.prompt, max_tokens=64, temperature=0.0, ignore_eos=True,
                               timeout=args.request_timeout, resume=True, resume_timeout_s=args.recovery_timeout)
        seen = 0
        try:
            async for _ in stream:
                seen += 1
                if seen >= leave_after:
                    break  # leaving the loop cancels the call: the server aborts the request
            outcome = "cancelled" if seen >= leave_after else "finished-early"
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
        if outcome != "cancelled":
            state.problem("wrong-code", {"kind": kind, "got": outcome, "expected": "cancelled"})
    elif kind == "deadline":
        spec = pool["greedy"][j]
        try:
            await client.generate(spec.prompt, max_tokens=64, temperature=0.0, ignore_eos=True,
                                  timeout=0.1 + 0.2 * (j % 5), resume=True)
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
        if outcome not in ("ok", "DEADLINE_EXCEEDED"):
            state.problem("wrong-code", {"kind": kind, "got": outcome, "expected": "ok or DEADLINE_EXCEEDED"})
    else:
        spec = pool[kind][j]
        try:
            result, resumes = await stream_tokens(client, spec, args.request_timeout, args.recovery_timeout)
            state.resumes += resumes
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
            state.problem("lost", {"kind": kind, "index": j, "status": outcome, "details": e.details()})
        else:
            if result is None or result.finish_reason not in ("stop", "length"):
                outcome = "unfinished"
                state.problem("lost", {"kind": kind, "index": j, "finish_reason": getattr(result, "finish_reason", None)})
            elif kind in CHECKED and list(result.token_ids) != reference[(kind, j)]:
                outcome = "mismatch"
                state.problem("mismatch", {"kind": kind, "index": j, "got": list(result.token_ids),
                                           "reference": reference[(kind, j)], "resumes": resumes})
            elif kind == "unseeded" and result.usage.completion_tokens != spec.max_tokens:
                outcome = "wrong-length"
                state.problem("mismatch", {"kind": kind, "index": j, "tokens": result.usage.completion_tokens})
    state.outcomes[f"{kind} {outcome}"] += 1
    state.completed += 1


async def _killer(session: int, at: list[int], client, args, state: SoakState, rng: random.Random) -> None:
    """At each count of completed requests in `at`: SIGKILL one rank of the current group (a worker process not
    seen at an earlier kill), then poll health until NOT_SERVING has been seen and SERVING is back."""
    seen: set[int] = set()
    for threshold in at:
        while state.completed < threshold:
            await asyncio.sleep(0.2)  # polling the soak's own counter
        current = [pid for pid in worker_pids(session) if pid not in seen]
        seen |= set(worker_pids(session))
        if not current:
            state.kills.append({"at_request": state.completed, "error": "no worker process of a new group found"})
            continue
        victim = rng.choice(current)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        record = {"at_request": state.completed, "t_s": round(killed - state.started, 1), "pid": victim,
                  "not_serving_after_s": None, "serving_again_s": None}
        while time.monotonic() - killed < args.recovery_timeout:
            try:
                health = await client.health(timeout=10)
            except grpc.aio.AioRpcError as e:
                health = e.code().name
            now = time.monotonic() - killed
            if health == "NOT_SERVING" and record["not_serving_after_s"] is None:
                record["not_serving_after_s"] = round(now, 2)
            if health == "SERVING" and record["not_serving_after_s"] is not None:
                record["serving_again_s"] = round(now, 2)
                break
            await asyncio.sleep(0.05)  # polling health, bounded by --recovery-timeout
        state.kills.append(record)


async def _sampler(serve_pid: int, session: int, interval_s: float, state: SoakState, stop: asyncio.Event) -> None:
    while True:
        sample = await asyncio.to_thread(memory_sample, serve_pid, session)
        state.memory.append({"t_s": round(time.monotonic() - state.started, 1), "completed": state.completed, **sample})
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except asyncio.TimeoutError:
            pass


async def run(address: str, serve_pid: int, session: int, schedule, pool, reference, limits: Limits, args,
              state: SoakState) -> None:
    from shardserve.client.clients import AsyncClient

    n = len(schedule)
    kill_at = [n * (k + 1) // (args.kills + 1) for k in range(args.kills)]
    stop = asyncio.Event()
    async with AsyncClient(address) as client, grpc.aio.insecure_channel(address) as channel:
        sampler = asyncio.create_task(_sampler(serve_pid, session, args.memory_interval, state, stop))
        killer = asyncio.create_task(_killer(session, kill_at, client, args, state, random.Random(args.schedule_seed + 1)))
        queue = iter(schedule)

        async def worker() -> None:
            for kind, j in queue:
                await _one(kind, j, client, channel, pool, reference, limits, args, state)

        progress = asyncio.create_task(_progress(state, n))
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await killer
        progress.cancel()
        stop.set()
        await sampler


async def _progress(state: SoakState, n: int) -> None:
    import sys

    while True:
        await asyncio.sleep(30)
        print(f"soak: {state.completed}/{n} requests, {len(state.kills)} kill(s), problems {dict(state.problems)}, "
              f"{time.monotonic() - state.started:.0f} s", file=sys.stderr, flush=True)
