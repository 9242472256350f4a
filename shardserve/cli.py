"""The `shardserve` command: generate | serve | client | bench."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a local HF folder, a .gguf file or a built-in name "
                        "(qwen3-0.6b, llama-3-8b, llama-3-70b); default: SmolLM2-135M-Instruct")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-prefix-caching", action="store_true")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        tensor_parallel_size=args.tp,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from shardserve import LLM, SamplingParams

    params = SamplingParams(**sampling_kwargs(args))
    with LLM(**engine_kwargs(args)) as llm:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from shardserve.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    try:
        from shardserve.cluster_cli import add_cluster_parsers
    except ImportError:  # the cluster part is optional until it lands
        pass
    else:
        add_cluster_parsers(sub, add_engine_args, add_sampling_args)
    from shardserve.gateway_cli import add_gateway_parser

    add_gateway_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
