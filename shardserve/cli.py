"""The `shardserve` command: generate | serve | client | gateway | bench."""

from __future__ import annotations

import argparse
import sys

from shardserve.bench.cli import add_bench_parser
from shardserve.cluster_cli import add_cluster_parsers
from shardserve.flags import add_engine_args, add_sampling_args, engine_kwargs, sampling_kwargs
from shardserve.gateway_cli import add_gateway_parser


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
    from shardserve import __version__

    parser = argparse.ArgumentParser(prog="shardserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen, exclude=("logprobs",))  # the terminal shows text only
    gen.set_defaults(func=cmd_generate)
    add_bench_parser(sub)
    add_cluster_parsers(sub)
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
