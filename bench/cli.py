"""`shardserve bench ...` argument parsing; each benchmark lives in its own module."""

from __future__ import annotations

import argparse


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results as JSON records with --json-out)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    offline = kinds.add_parser("offline", help="throughput of a batch of random prompts")
    add_engine_args(offline)
    offline.add_argument("--num-prompts", type=int, default=256)
    offline.add_argument("--input-len", default="100-1024", help="N or LOW-HIGH (uniform)")
    offline.add_argument("--output-len", default="100-1024", help="N or LOW-HIGH (uniform)")
    offline.add_argument("--temperature", type=float, default=0.6)
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--compare", choices=["hf"], default=None, help="also run transformers on the same prompts")
    offline.add_argument("--hf-prompts", type=int, default=64, help="how many prompts transformers runs")
    offline.add_argument("--cluster", action="store_true", help="through the Ray/gRPC cluster instead of in-process")
    offline.add_argument("--json-out", default=None)
    offline.set_defaults(func=_run("shardserve.bench.offline"))

    latency = kinds.add_parser("latency", help="bs=1 decode ms/token")
    add_engine_args(latency)
    latency.add_argument("--input-len", type=int, default=128)
    latency.add_argument("--output-len", type=int, default=256)
    latency.add_argument("--batch-size", type=int, default=1)
    latency.add_argument("--json-out", default=None)
    latency.set_defaults(func=_run("shardserve.bench.latency"))


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        from shardserve.cli import engine_kwargs

        return importlib.import_module(module).main(args, engine_kwargs(args))

    return run
