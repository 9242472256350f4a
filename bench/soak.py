"""`shardserve bench soak`: many requests of every kind against a real `shardserve serve`, with worker ranks killed.

Starts `shardserve serve` on 127.0.0.1 (its own local Ray; the engine flags given here), runs the pool's checked
streams once undisturbed (the reference), then --requests requests from --concurrency clients: valid streams
(greedy, seeded, unseeded, with stop strings, of various lengths), invalid requests (each must get its status),
cancellations and deadlines, while --kills worker ranks are SIGKILLed at evenly spread points. At the end the KV
blocks in use must return to 0, and the memory of serve and its Ray processes (sampled every --memory-interval
seconds) must be flat. Passes (exit 0) with 0 lost, 0 wrong codes, 0 mismatches, 0 leaked blocks, every kill
recovered and flat memory; the JSON record (--json-out) keeps the outcomes, the kills and the memory over time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from shardserve.bench.record import BenchRecord


def add_soak_parser(kinds, add_engine_args, run) -> None:
    parser = kinds.add_parser("soak", help="many requests of every kind, worker ranks killed: nothing lost, right "
                              "codes, no leaked blocks, flat memory", description="Its TP size defaults to 3 (a group "
                              "of ranks to kill): the default model's heads allow 1 or 3.")
    add_engine_args(parser)
    parser.add_argument("--requests", type=int, default=10000, help="requests sent after the reference run")
    parser.add_argument("--kills", type=int, default=3, help="worker ranks SIGKILLed, evenly spread over the run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--pool", type=int, default=24,
                        help="distinct streams per valid kind (greedy, seeded, stop strings, unseeded)")
    parser.add_argument("--schedule-seed", type=int, default=0,
                        help="seeds the request schedule, the pool's seeds and the choice of victims")
    parser.add_argument("--memory-interval", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--max-memory-growth-mb", type=float, default=64.0,
                        help="largest growth of serve + controller PSS (first tenth of the run to the last) that "
                        "counts as flat")
    parser.add_argument("--recovery-timeout", type=float, default=300.0,
                        help="seconds a killed group may take to serve again (and a broken stream to resume)")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="deadline of each valid stream, seconds")
    parser.add_argument("--max-request-bytes", type=int, default=16384,
                        help="the server's --max-request-bytes (an invalid kind sends more)")
    parser.add_argument("--max-prompt-bytes", type=int, default=4096,
                        help="the server's --max-prompt-bytes (an invalid kind sends more)")
    parser.add_argument("--json-out", default=None, help="write the result as a JSON record to this file")
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    parser.set_defaults(func=run, engine_defaults=vars(engine.parse_args([])), tensor_parallel_size=3)


def _memory_growth(samples: list[dict], roles=("serve", "controller")) -> dict:
    """PSS of the long-lived processes (serve and the controller actor: worker ranks are replaced at each kill)
    early and at the end of the run: the mean of the second tenth of the samples (the first is warm-up: imports,
    allocator pools, the first of each request shape) and of the last tenth, and the difference."""
    if len(samples) < 2:
        return {"start_mb": None, "end_mb": None, "growth_mb": None}
    tenth = max(1, len(samples) // 10)
    total = [sum(s[r]["pss_mb"] for r in roles) for s in samples]
    early = total[tenth:2 * tenth] or total[:1]
    start, end = sum(early) / len(early), sum(total[-tenth:]) / tenth
    return {"start_mb": round(start, 1), "end_mb": round(end, 1), "growth_mb": round(end - start, 1)}


def memory_table(samples: list[dict], rows: int = 12) -> str:
    """A markdown table of about `rows` evenly spaced samples: PSS per role, MB."""
    step = max(1, (len(samples) - 1) // (rows - 1)) if len(samples) > 1 else 1
    picked = samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else [])
    lines = ["| t (s) | requests done | serve | controller | workers | ray | total |", "|" + " --- |" * 7]
    for s in picked:
        lines.append(f"| {s['t_s']:.0f} | {s['completed']} | " + " | ".join(
            f"{s[r]['pss_mb']:.0f}" for r in ("serve", "controller", "workers", "ray", "total")) + " |")
    return "\n".join(lines)


async def _leftover_blocks(address: str, timeout_s: float = 60.0) -> dict:
    """Polls the server's stats until nothing is running, waiting or holding blocks (or timeout_s): the last stats."""
    from shardserve.client.clients import AsyncClient

    async with AsyncClient(address) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await client.server_stats(timeout=30)
            if not (stats.kv_blocks_used or stats.num_running or stats.num_waiting) or time.monotonic() > deadline:
                return {"kv_blocks_used": stats.kv_blocks_used, "num_running": stats.num_running,
                        "num_waiting": stats.num_waiting, "requests_finished": stats.requests_finished,
                        "requests_aborted": stats.requests_aborted, "requests_rejected": stats.requests_rejected}
            await asyncio.sleep(0.1)  # polling the server's counters, bounded by the deadline


async def _soak(server, args) -> dict:
    from shardserve.bench import soak_run
    from shardserve.bench.soak_procs import ray_session
    from shardserve.bench.soak_requests import Limits, make_pool, make_schedule
    from shardserve.client.clients import AsyncClient

    rng = random.Random(args.schedule_seed)
    session = ray_session(server.proc.pid)
    async with AsyncClient(server.address) as client:
        info = await client.model_info(timeout=60)
        limits = Limits(info.vocab_size, info.max_model_len, args.max_prompt_bytes, args.max_request_bytes)
        pool = make_pool(args.pool, rng, None if info.tokenizer else info.vocab_size)
        started = time.monotonic()
        reference = await soak_run.reference_tokens(client, pool, args.concurrency, args.request_timeout)
        reference_s = time.monotonic() - started
    schedule = make_schedule(args.requests, pool, rng)
    state = soak_run.SoakState()
    await soak_run.run(server.address, server.proc.pid, session, schedule, pool, reference, limits, args, state)
    elapsed = time.monotonic() - state.started
    leftover = await _leftover_blocks(server.address)
    return {"model": info.model, "reference_s": round(reference_s, 1), "elapsed_s": round(elapsed, 1),
            "requests": args.requests, "requests_per_s": round(args.requests / elapsed, 2),
            "outcomes": dict(sorted(state.outcomes.items())), "problems": dict(state.problems),
            "examples": state.examples, "resumes": state.resumes, "kills": state.kills, "leftover": leftover,
            "memory_growth": _memory_growth(state.memory), "memory": state.memory}


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.serve_server import LaunchedServer, engine_flags
    from shardserve.settings.resolve import build_engine_config

    flags = engine_flags(args) + ["--max-request-bytes", str(args.max_request_bytes),
                                  "--max-prompt-bytes", str(args.max_prompt_bytes)]
    server = LaunchedServer(flags, http=False)
    try:
        result = asyncio.run(_soak(server, args))
    finally:
        server.stop()
    result["serve_exit_code"] = server.proc.returncode
    recovered = [k for k in result["kills"] if k.get("serving_again_s") is not None]
    growth = result["memory_growth"]["growth_mb"]
    result["passed"] = bool(
        not result["problems"] and len(recovered) >= args.kills and result["leftover"]["kv_blocks_used"] == 0
        and (growth is None or growth <= args.max_memory_growth_mb) and result["serve_exit_code"] == 0)
    print(f"soak: {args.requests} requests in {result['elapsed_s']:.0f} s, outcomes {result['outcomes']}\n"
          f"problems {result['problems'] or 'none'}; {len(recovered)}/{args.kills} kills recovered "
          f"{[k.get('serving_again_s') for k in result['kills']]} s; {result['resumes']} resumes; "
          f"leftover {result['leftover']}; serve + controller PSS {result['memory_growth']}; "
          f"serve exit {result['serve_exit_code']}: {'PASSED' if result['passed'] else 'FAILED'}\n"
          + memory_table(result["memory"]), file=sys.stderr)
    config = build_engine_config(**engine_kwargs)
    record = BenchRecord.for_engine("soak", result["model"], config,
                                    workload={"requests": args.requests, "kills": args.kills,
                                              "concurrency": args.concurrency, "pool": args.pool, "schedule_seed": args.schedule_seed},
                                    notes=result)
    record.write(args.json_out)
    return 0 if result["passed"] else 1
