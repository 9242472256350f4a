"""`shardserve bench prompt-stall`: does a flood of huge prompts stall the other streams?

One greedy stream runs alone (the baseline), then again while --flood-clients clients keep sending prompts of
--prompt-mb megabytes of text (each refused: over the byte limit before tokenizing, or over max_model_len after).
Reported for both: the stream's median and largest gap between two deltas, and their ratio; the flood's answers by
status code. The server is a running one (--address) or `shardserve serve` started here with the engine flags and
--max-prompt-bytes (raise it past the prompts' size to make the server tokenize them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter

from shardserve.bench.record import BenchRecord


def add_prompt_stall_parser(kinds, add_engine_args, run) -> None:
    parser = kinds.add_parser("prompt-stall", help="a stream's largest inter-token gap while others send huge prompts")
    add_engine_args(parser)
    parser.add_argument("--address", default=None, metavar="HOST:PORT", help="a running server (else start one)")
    parser.add_argument("--max-prompt-bytes", type=int, default=None, help="passed to the server started here")
    parser.add_argument("--flood-clients", type=int, default=4, help="clients sending huge prompts meanwhile")
    parser.add_argument("--prompt-mb", type=float, default=3.9, help="megabytes of text in each flood prompt")
    parser.add_argument("--output-len", type=int, default=200, help="tokens of the measured stream")
    parser.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    parser.set_defaults(func=run, engine_defaults=vars(engine.parse_args([])))


def _stream_gaps(client, output_len: int) -> tuple[list[float], str | None]:
    """Seconds between consecutive deltas of one greedy stream (from its first delta on), and the status it ended
    with when it did not finish (a stalled server: DEADLINE_EXCEEDED after the client's 600 s)."""
    import grpc

    times, started = [], time.perf_counter()
    try:
        for _ in client.stream("Tell me a long story about the sea.", max_tokens=output_len, temperature=0.0,
                               ignore_eos=True):
            times.append(time.perf_counter())
    except grpc.RpcError as e:
        return [b - a for a, b in zip(times, times[1:])], (
            f"{e.code().name} after {time.perf_counter() - started:.0f} s and {len(times)} deltas")
    return [b - a for a, b in zip(times, times[1:])], None


def _flood(address: str, text: str, stop: threading.Event, codes: Counter, lock: threading.Lock) -> None:
    import grpc

    from shardserve.client.clients import Client

    with Client(address, timeout=600) as client:
        while not stop.is_set():
            try:
                client.generate(text, max_tokens=1)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                codes[code] += 1


def _summary(measured: tuple[list[float], str | None]) -> dict:
    gaps, failed = measured
    if failed is not None or len(gaps) < 2:
        return {"failed": failed or "too few deltas", "deltas": len(gaps) + 1 if gaps else 0}
    median, largest = statistics.median(gaps), max(gaps)
    return {"median_gap_s": round(median, 4), "max_gap_s": round(largest, 4),
            "max_over_median": round(largest / median, 2), "deltas": len(gaps) + 1}


def measure(address: str, args: argparse.Namespace) -> dict:
    from shardserve.client.clients import Client

    size = int(args.prompt_mb * 1e6)
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
    with Client(address, timeout=600) as client:
        _stream_gaps(client, 8)  # warm-up
        alone = _summary(_stream_gaps(client, args.output_len))
        stop, lock, codes = threading.Event(), threading.Lock(), Counter()
        flood = [threading.Thread(target=_flood, args=(address, text, stop, codes, lock), daemon=True)
                 for _ in range(args.flood_clients)]
        for t in flood:
            t.start()
        try:
            loaded = _summary(_stream_gaps(client, args.output_len))
        finally:
            stop.set()
            for t in flood:
                t.join(600)
    return {"alone": alone, "flooded": loaded, "flood_answers": dict(codes), "prompt_bytes": len(text),
            "flood_clients": args.flood_clients}


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.serve_server import LaunchedServer, engine_flags
    from shardserve.settings.resolve import build_engine_config

    server = None
    address = args.address
    if address is None:
        flags = engine_flags(args)
        if args.max_prompt_bytes is not None:
            flags += ["--max-prompt-bytes", str(args.max_prompt_bytes)]
        server = LaunchedServer(flags, http=False)
        address = server.address
    try:
        result = measure(address, args)
    finally:
        if server is not None:
            server.stop()
    print(f"alone:   {result['alone']}\nflooded: {result['flooded']}  ({args.flood_clients} clients x "
          f"{result['prompt_bytes'] / 1e6:.1f} MB prompts: {result['flood_answers']})", file=sys.stderr)
    config = build_engine_config(**engine_kwargs)
    record = BenchRecord.for_engine("prompt-stall", None, config,
                                    workload={"output_len": args.output_len, "flood_clients": args.flood_clients,
                                              "prompt_bytes": result["prompt_bytes"],
                                              "max_prompt_bytes": args.max_prompt_bytes},
                                    notes=result)
    record.write(args.json_out)
    return 0
