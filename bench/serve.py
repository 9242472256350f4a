"""`shardserve bench serve`: online serving, as `vllm bench serve` measures it, over gRPC or the HTTP gateway.

    shardserve bench serve --request-rates 1,2,4,inf --api both --json-out r.json --plot r.png   # starts a server
    shardserve bench serve --address 127.0.0.1:50051 --max-concurrency 8                        # a running one

Requests arrive as a Poisson process at --request-rate (or each rate of --request-rates in turn), or all at once
under --max-concurrency. Each run reports request throughput, output tok/s, TTFT, TPOT (per request: time after
the first token / tokens after the first), ITL (between successive token-bearing messages) and end-to-end latency
(mean, p50, p99), and goodput: requests/s that met every SLO given (--slo-ttft-ms, --slo-tpot-ms).
Workloads: random token ids (--input-len / --output-len, N or LOW-HIGH), shared prefixes (--prefix-len,
--num-prefixes), or a JSON-lines --prompt-file ({"prompt"|"messages"|"token_ids": ..., "max_tokens": N}).
Random prompts go as text when the benchmark has the model's tokenizer on this machine (--tokenizer PATH, or the
model of the server it started), else as token ids. No model hub is ever asked: the server's model name is never
looked up.
--json-out: one BenchRecord ("serve") per run, a JSON list when there are several.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from dataclasses import asdict

from shardserve.bench.record import BenchRecord, Stats, device_name
from shardserve.bench.serve_requests import BenchRequest, GrpcSender, HttpSender, RequestResult, run_requests
from shardserve.bench.workload import parse_range, random_workload


def add_serve_parser(kinds, add_engine_args, run) -> None:
    """Registers `bench serve` (bench/commands.py calls this); the engine flags only matter when it starts the server."""
    parser = kinds.add_parser("serve", help="online serving: request rate or concurrency against gRPC or HTTP")
    add_engine_args(parser)
    add_serve_args(parser)
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    # the engine flags' defaults: those the user changed are passed on to the server it starts
    parser.set_defaults(func=run, engine_defaults=vars(engine.parse_args([])))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target (neither --address nor --http: start `shardserve serve` here)")
    target.add_argument("--address", default=None, metavar="HOST:PORT", help="a running server's gRPC API")
    target.add_argument("--http", default=None, metavar="URL", help="a running gateway, e.g. http://127.0.0.1:8000")
    target.add_argument("--api", choices=["grpc", "http", "both"], default=None,
                        help="what to measure (default: http with --http alone, else grpc)")
    target.add_argument("--ray-address", default="local", help="the Ray a started server uses")
    target.add_argument("--gateway-workers", type=int, default=0,
                        help="a started server's gateway: 0 = in the serve process (--http-port), N = a "
                             "`shardserve gateway --workers N` process of its own")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    load.add_argument("--request-rates", default=None, help="a sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    load.add_argument("--num-prompts", type=int, default=200, help="requests per run")
    load.add_argument("--dataset", choices=["random", "shared-prefix"], default="random", help="how prompts are made")
    load.add_argument("--prompt-file", default=None, help="JSON lines of prompts (instead of --dataset)")
    load.add_argument("--input-len", default="256", help="N or LOW-HIGH (uniform)")
    load.add_argument("--output-len", default="128", help="N or LOW-HIGH (uniform)")
    load.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each prefix")
    load.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: how many distinct prefixes")
    load.add_argument("--prompt-format", choices=["auto", "text", "token-ids"], default="auto",
                      help="random prompts as text (needs the tokenizer) or token ids; auto: text when possible")
    load.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="a local folder with the served model's tokenizer files, to send random prompts as text "
                      "to a running server (never looked up on a model hub; default: the started server's model)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    load.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: exact lengths)")
    load.add_argument("--warmup", type=int, default=2, help="requests sent before each API's first run")
    out = parser.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token at most this")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: time per output token at most this")
    out.add_argument("--json-out", default=None, help="append the results as JSON records to this file")
    out.add_argument("--plot", default=None, metavar="PNG", help="latency against throughput (needs matplotlib)")


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from shardserve.bench.serve_server import LaunchedServer, engine_flags

    api = args.api or ("http" if args.http and not args.address else "grpc")
    apis = ["grpc", "http"] if api == "both" else [api]
    server = None
    address, http_url = args.address, args.http
    if not address and not http_url:
        server = LaunchedServer(engine_flags(args), http="http" in apis, ray_address=args.ray_address,
                                gateway_workers=args.gateway_workers)
        address, http_url = server.address, server.http_url
    try:
        if "grpc" in apis and not address or "http" in apis and not http_url:
            raise SystemExit("bench serve: --api grpc needs --address, --api http needs --http (or neither: "
                             "the benchmark then starts its own server)")
        info = model_info(address, http_url)
        info["started"] = server is not None  # its model's tokenizer is on this machine
        requests = build_requests(args, info)
        rates = [float(r) for r in args.request_rates.split(",")] if args.request_rates else [args.request_rate]
        records = asyncio.run(sweep(args, apis, address, http_url, requests, rates, info, server is not None))
    finally:
        if server is not None:
            server.stop()
    dicts = [asdict(r) for r in records]
    if args.json_out:
        write_json(args.json_out, dicts[0] if len(dicts) == 1 else dicts)
    if args.plot:
        from shardserve.bench.serve_plot import plot_sweep

        plot_sweep(dicts, args.plot, f"{info['model']} tp={info['tp']}: {describe(args)}")
    return 0 if all(r.notes["completed"] for r in records) else 1


# ---- the model and the workload -----------------------------------------------------------------------------
def model_info(address: str | None, http_url: str | None) -> dict:
    """What the benchmark needs to know of the served model: over gRPC when it can, else the gateway's /v1/models."""
    if address:
        from shardserve.client.clients import Client

        with Client(address, timeout=30) as client:
            m = client.model_info()
        return dict(model=m.model, tp=m.tensor_parallel_size, replicas=m.replicas, vocab_size=m.vocab_size,
                    tokenizer=m.tokenizer or None, eos=set(m.eos_token_ids), has_chat_template=m.has_chat_template)
    import urllib.request

    with urllib.request.urlopen(http_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=30) as reply:
        m = json.load(reply)["data"][0]
    return dict(model=m["id"], tp=m.get("tensor_parallel_size", 1), replicas=1, vocab_size=m.get("vocab_size", 32000),
                tokenizer=None, eos=set(), has_chat_template=m.get("has_chat_template", False))


def build_requests(args: argparse.Namespace, info: dict) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    out_low, out_high = parse_range(args.output_len)
    if args.prompt_file:
        return file_requests(args.prompt_file, args.num_prompts, (out_low, out_high), rng)
    n = args.num_prompts
    work = random_workload(n, parse_range(args.input_len), (out_low, out_high), info["vocab_size"], args.seed,
                           avoid_ids=info["eos"])
    prompts = work.prompts
    if args.dataset == "shared-prefix":
        prefixes = random_workload(args.num_prefixes, (args.prefix_len, args.prefix_len), (1, 1), info["vocab_size"],
                                   args.seed + 1, avoid_ids=info["eos"]).prompts
        prompts = [prefixes[i % len(prefixes)] + p for i, p in enumerate(prompts)]
    tokenizer = None
    if args.prompt_format != "token-ids":
        tokenizer = load_tokenizer(local_tokenizer_dir(args, started=info.get("started", False)))
    if args.prompt_format == "text" and tokenizer is None:
        raise SystemExit("bench serve: --prompt-format text against a running server needs the model's tokenizer on "
                         "this machine: give --tokenizer PATH (a local folder)")
    info["prompt_format"] = "text" if tokenizer is not None else "token-ids"
    return [BenchRequest(tokenizer.decode(p) if tokenizer is not None else p, out, len(p))
            for p, out in zip(prompts, work.output_lens)]


def local_tokenizer_dir(args: argparse.Namespace, started: bool) -> str | None:
    """Where the served model's tokenizer is on this machine: --tokenizer, or for a server the benchmark started, its
    model's own folder (the same resolution `serve` made here). A running server's model name is not a path here,
    and is never looked up on a model hub."""
    if getattr(args, "tokenizer", None):
        return args.tokenizer
    if started:
        from shardserve.settings.model_source import resolve_model

        return resolve_model(args.model, args.load_format).tokenizer_dir
    return None


def load_tokenizer(path: str | None):
    """The tokenizer in a local folder (no hub lookup: local files only), or None without one."""
    if not path:
        return None
    if not os.path.isdir(path):
        raise SystemExit(f"bench serve: --tokenizer {path}: no such folder (a local folder with the model's "
                         "tokenizer files; nothing is fetched from a model hub)")
    from shardserve.settings.model_source import hub_offline
    from transformers import AutoTokenizer

    with hub_offline():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)


def file_requests(path: str, limit: int, output_len: tuple[int, int], rng: random.Random) -> list[BenchRequest]:
    requests = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            entry = json.loads(line)
            prompt = next((entry[k] for k in ("prompt", "messages", "token_ids") if k in entry), None)
            if prompt is None:
                raise SystemExit(f"bench serve: a prompt-file line needs prompt, messages or token_ids: {line[:200]}")
            out = entry.get("max_tokens", entry.get("output_len")) or rng.randint(*output_len)
            requests.append(BenchRequest(prompt, int(out)))
    if not requests:
        raise SystemExit(f"bench serve: {path} has no prompts")
    return [requests[i % len(requests)] for i in range(limit)]  # repeated up to --num-prompts


def describe(args: argparse.Namespace) -> str:
    work = f"prompt file {args.prompt_file}" if args.prompt_file else (
        f"{args.dataset}, in {args.input_len}, out {args.output_len}"
        + (f", {args.num_prefixes} prefixes of {args.prefix_len}" if args.dataset == "shared-prefix" else ""))
    conc = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
    return f"{args.num_prompts} requests, {work}{conc}"


# ---- runs ---------------------------------------------------------------------------------------------------
async def sweep(args, apis, address, http_url, requests, rates, info, launched: bool) -> list[BenchRecord]:
    sampling = {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos}
    senders = {"grpc": lambda: GrpcSender(address, sampling), "http": lambda: HttpSender(http_url, sampling)}
    records = []
    for api in apis:
        send = senders[api]()
        try:
            if args.warmup:
                await run_requests(send, requests[: args.warmup], math.inf, None, desc=f"{api} warm-up")
            for rate in rates:
                label = f"{api} @ {rate:g}/s" + (f", concurrency {args.max_concurrency}" if args.max_concurrency else "")
                results, duration = await run_requests(send, requests, rate, args.max_concurrency, args.burstiness,
                                                       args.seed, desc=label)
                record = to_record(args, api, rate, results, duration, info, launched)
                print_summary(label, record)
                records.append(record)
        finally:
            await send.close()
    return records


def to_record(args, api: str, rate: float, results: list[RequestResult], duration: float, info: dict,
              launched: bool) -> BenchRecord:
    done = [r for r in results if r.ok]
    ms = lambda values: Stats.of([v * 1000 for v in values])  # noqa: E731
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if (args.slo_ttft_ms is None or r.ttft_s * 1000 <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or (r.tpot_s or 0) * 1000 <= args.slo_tpot_ms)]
    errors = sorted({r.error for r in results if r.error})
    device = args.device if launched else "unknown (a running server)"
    if launched and device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return BenchRecord(
        benchmark="serve", model=info["model"], load_format=args.load_format if launched else "unknown",
        device=device_name(device) if launched else device,
        num_gpus=info["tp"] * info["replicas"] if device == "cuda" else 0, tp=info["tp"], replicas=info["replicas"],
        workload=dict(api=api, num_prompts=len(results), request_rate=rate if math.isfinite(rate) else "inf",
                      max_concurrency=args.max_concurrency, burstiness=args.burstiness,
                      dataset="file" if args.prompt_file else args.dataset, prompt_file=args.prompt_file,
                      input_len=args.input_len, output_len=args.output_len,
                      prefix_len=args.prefix_len if args.dataset == "shared-prefix" else None,
                      num_prefixes=args.num_prefixes if args.dataset == "shared-prefix" else None,
                      prompt_format=info.get("prompt_format", "file"), temperature=args.temperature,
                      ignore_eos=not args.no_ignore_eos, seed=args.seed),
        output_tokens_per_s=output_tokens / duration, total_tokens_per_s=(input_tokens + output_tokens) / duration,
        ttft_ms=ms([r.ttft_s for r in done]), tpot_ms=ms([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=ms([x for r in done for x in r.itl_s]), e2e_ms=ms([r.e2e_s for r in done]),
        notes=dict(api=api, completed=len(done), failed=len(results) - len(done), duration_s=duration,
                   request_throughput=len(done) / duration, total_input_tokens=input_tokens,
                   total_output_tokens=output_tokens, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                   goodput=len(good) / duration if args.slo_ttft_ms or args.slo_tpot_ms else None,
                   errors=errors[:5],
                   gateway_workers=(args.gateway_workers if launched else None) if api == "http" else None),
    )


def print_summary(label: str, r: BenchRecord) -> None:
    n = r.notes

    def stats(name: str, s: Stats | None) -> str:
        return f"{name:<5} mean {s.mean:9.2f}  p50 {s.p50:9.2f}  p99 {s.p99:9.2f} ms" if s else f"{name:<5} -"

    lines = [f"==== {label}: {n['completed']} ok, {n['failed']} failed in {n['duration_s']:.2f} s",
             f"request throughput {n['request_throughput']:.2f} req/s, output {r.output_tokens_per_s:.1f} tok/s, "
             f"total {r.total_tokens_per_s:.1f} tok/s"
             + (f", goodput {n['goodput']:.2f} req/s" if n["goodput"] is not None else ""),
             stats("TTFT", r.ttft_ms), stats("TPOT", r.tpot_ms), stats("ITL", r.itl_ms), stats("E2E", r.e2e_ms)]
    if n["errors"]:
        lines.append(f"errors: {n['errors']}")
    print("\n".join(lines), flush=True)


def write_json(path: str, payload) -> None:
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(payload, indent=2) + "\n")
