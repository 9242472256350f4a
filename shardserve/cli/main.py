"""The `shardserve` command: generate | serve | client | gateway | bench."""

from __future__ import annotations

import argparse
import sys

from shardserve.bench.commands import add_bench_parser
from shardserve.cli.server_commands import add_cluster_parsers
from shardserve.cli.flags import add_engine_args, add_sampling_args, engine_kwargs, sampling_kwargs
from shardserve.cli.gateway_commands import add_gateway_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from shardserve import LLM, SamplingParams

    params = SamplingParams(**sampling_kwargs(args))
    with LLM(**engine_kwargs(args)) as llm:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        logprobs, prompt_logprobs = [], None
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            logprobs += delta.logprobs or []
            prompt_logprobs = delta.prompt_logprobs or prompt_logprobs
        sys.stdout.write("\n")
    if prompt_logprobs:
        print_logprobs("prompt", prompt_logprobs)
    if logprobs:
        print_logprobs("generated", logprobs)
    return 0


def print_logprobs(title: str, positions) -> None:
    """One line per position on stderr: the token, its logprob and rank, then the top alternatives."""
    print(f"[{title} logprobs: token (logprob, rank) | top]", file=sys.stderr)
    for entries in positions:
        if entries is None:
            print("  (first token: none)", file=sys.stderr)
            continue
        (token, chosen), *others = entries.items()
        top = "  ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for _, lp in others)
        print(f"  {chosen.decoded_token!r} ({chosen.logprob:.3f}, {chosen.rank}) | {top}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from shardserve import __version__

    parser = argparse.ArgumentParser(prog="shardserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    # --seed is the engine's (as vLLM's); a request seed of its own is --request-seed. Logprobs go to stderr.
    add_sampling_args(gen, renamed={"seed": "request-seed"})
    gen.set_defaults(func=cmd_generate)
    add_bench_parser(sub)
    add_cluster_parsers(sub)
    add_gateway_parser(sub)
    _show_defaults(parser)
    return parser


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, but a help that already speaks of its default ("(default 4 MiB)", or
    %(default)s) gets no second "(default: None)"."""

    def _get_help_string(self, action) -> str:
        help = action.help or ""
        return help if "default" in help else super()._get_help_string(action)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help shows each flag's default once (argparse's defaults formatter, on the whole tree)."""
    parser.formatter_class = _DefaultsOnce
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


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
