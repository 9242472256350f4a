"""`shardserve bench ...` argument parsing; each benchmark lives in its own module."""

from __future__ import annotations

import argparse

from shardserve.cli.flags import add_engine_args, engine_kwargs


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results as JSON records with --json-out)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    offline = kinds.add_parser("offline", help="throughput of a batch of random prompts")
    add_engine_args(offline)
    offline.add_argument("--num-prompts", default="auto",
                         help="how many random prompts (auto: 256 on CUDA, 16 on CPU)")
    offline.add_argument("--input-len", default="auto", help="N or LOW-HIGH (uniform; auto: 100-1024 on CUDA, 32-128 on CPU)")
    offline.add_argument("--output-len", default="auto", help="N or LOW-HIGH (uniform; auto: 100-1024 on CUDA, 32-128 on CPU)")
    offline.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    offline.add_argument("--compare", choices=["hf"], default=None, help="also run transformers on a sample")
    offline.add_argument("--hf-prompts", type=int, default=64, help="how many prompts transformers runs")
    offline.add_argument("--hf-dtype", default="same",
                         help="the dtype transformers runs in: same (the engine's), checkpoint (transformers' own "
                         "default: the model's config.json), or a dtype name")
    offline.add_argument("--hf-method", choices=["auto", "generate_batch", "padded"], default="auto",
                         help="auto: generate_batch (continuous batching) on CUDA, a padded generate on CPU")
    offline.add_argument("--cluster", action="store_true",
                         help="also run the workload through the Ray + gRPC cluster and print the ratio")
    offline.add_argument("--no-roofline", action="store_true", help="skip measuring the ceiling")
    offline.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    offline.add_argument("--profile", default=None, metavar="PATH", help="torch profiler table of the timed run")
    offline.add_argument("--repeats", type=int, default=1,
                         help="timed runs on one engine (other prompt tokens, the same lengths); the record's figure "
                         "is their median, every run's in its notes (the first run alone is profiled)")
    offline.set_defaults(func=_run("shardserve.bench.offline"))

    latency = kinds.add_parser("latency", help="decode ms/token at a small batch, against the weight-read bound")
    add_engine_args(latency)
    latency.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    latency.add_argument("--output-len", type=int, default=256, help="tokens generated per request")
    latency.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    latency.add_argument("--workload", choices=("random", "grounded"), default="random",
                         help="random: random token ids (--input-len); grounded: each prompt asks for a passage "
                         "in it to be copied (speculative decoding's case; with a tokenizer the prompt is one of two passages, "
                         "without one --input-len random ids and their first 8 again)")
    latency.add_argument("--no-roofline", action="store_true", help="skip measuring the bound")
    latency.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    latency.add_argument("--profile", default=None, metavar="PATH", help="torch profiler table of the timed run")
    latency.set_defaults(func=_run("shardserve.bench.latency"))

    control = kinds.add_parser("control-plane", help="share of a decode step spent outside the workers")
    add_engine_args(control)
    control.add_argument("--num-prompts", type=int, default=64, help="how many random prompts")
    control.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    control.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    control.add_argument("--min-batch", type=int, default=None, help="decode steps counted (default: num-prompts)")
    control.add_argument("--executor", choices=["cluster", "local", "both"], default="both", help="which executor to measure")
    control.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    control.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    control.set_defaults(func=_run("shardserve.bench.control_plane"))
    probe = kinds.add_parser("probe", help="where a step's time goes on one GPU: host, forward, LM head, sampling")
    add_engine_args(probe)
    probe.add_argument("--batch-sizes", default="1,64,256", help="decode batch sizes, comma-separated")
    probe.add_argument("--context-len", type=int, default=800, help="context tokens of each decode row")
    probe.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every row")
    probe.add_argument("--repeats", type=int, default=20, help="timed repetitions of each part")
    probe.add_argument("--prefill-tokens", type=int, default=8192, help="0: no prefill probe")
    probe.add_argument("--prefill-seq-len", type=int, default=1024, help="tokens of each prefill sequence")
    probe.add_argument("--sweep-attention", default="", metavar="BxC,...",
                       help="also time the decode kernel's launch settings at these batch x context shapes")
    probe.add_argument("--attention-rates", default="", metavar="BxC,...",
                       help="also each attention kernel's bytes/s (bf16 and FP8 caches, scattered blocks) at these "
                       "batch x context shapes; BxLOW-HIGH: B contexts spread from LOW to HIGH tokens, the decode "
                       "kernel in batch order and longest first")
    probe.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    probe.set_defaults(func=_run("shardserve.bench.probe"))

    quality = kinds.add_parser("kv-quality", help="the FP8 KV cache (or FP8 weights) against the model's dtype: "
                               "greedy agreement, KL")
    add_engine_args(quality)
    quality.add_argument("--fp8", choices=("kv", "weights", "both"), default="kv",
                         help="what the compared run holds in FP8: the KV cache (kv_cache_dtype=fp8), the linear "
                         "layers' weights (quantization=fp8) or both; the reference holds neither")
    quality.add_argument("--num-prompts", type=int, default=16, help="prompts of the fixed prompt set")
    quality.add_argument("--max-tokens", type=int, default=64, help="tokens generated (and compared) per prompt")
    quality.add_argument("--json-out", default=None, help="append the result as a JSON record to this file")
    quality.set_defaults(func=_run("shardserve.bench.kv_quality"))

    from shardserve.bench.serve import add_serve_parser

    add_serve_parser(kinds, add_engine_args, _run("shardserve.bench.serve"))

    from shardserve.bench.routing import add_routing_parser
    from shardserve.bench.scaling import add_scaling_parser

    add_routing_parser(kinds)
    add_scaling_parser(kinds, add_engine_args, _run("shardserve.bench.scaling"))

    from shardserve.bench.prompt_stall import add_prompt_stall_parser

    add_prompt_stall_parser(kinds, add_engine_args, _run("shardserve.bench.prompt_stall"))

    from shardserve.bench.host import add_host_parser

    add_host_parser(kinds, add_engine_args, _run("shardserve.bench.host"))

    from shardserve.bench.soak import add_soak_parser

    add_soak_parser(kinds, add_engine_args, _run("shardserve.bench.soak"))
    from shardserve.bench.pipeline import add_parser as add_pipeline_parser

    add_pipeline_parser(kinds, add_engine_args, _run("shardserve.bench.pipeline"))

    from shardserve.bench.gateway_abuse import add_gateway_abuse_parser

    add_gateway_abuse_parser(kinds, add_engine_args, _run("shardserve.bench.gateway_abuse"))


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).main(args, engine_kwargs(args))

    return run
