"""The `shardserve` command: generate | serve | client | gateway | bench."""

from __future__ import annotations

import argparse
import sys

from shardserve.bench.commands import add_bench_parser
from shardserve.cli.client_command import add_client_parser, print_logprobs
from shardserve.cli.server_commands import add_cluster_parsers
from shardserve.cli.flags import add_engine_args, add_sampling_args, engine_kwargs, sampling_kwargs
from shardserve.cli.gateway_commands import add_gateway_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from shardserve import LLM, SamplingParams

    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ValueError("give a prompt or --prompt-token-ids (not both)")
    if args.prompt_token_ids is not None and args.chat:
        raise ValueError("--chat wraps a text prompt: it does not go with --prompt-token-ids")
    params = SamplingParams(**sampling_kwargs(args))
    with LLM(**engine_kwargs(args)) as llm:
        if args.prompt_token_ids is not None:
            prompt = args.prompt_token_ids
        else:
            prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        logprobs, prompt_logprobs = [], None
        ids_only = llm.tokenizer is None  # a model without a tokenizer: its output is token ids
        for delta in llm.stream(prompt, params):
            sys.stdout.write("".join(f" {t}" for t in delta.token_ids) if ids_only else delta.text)
            sys.stdout.flush()
            logprobs += delta.logprobs or []
            prompt_logprobs = delta.prompt_logprobs or prompt_logprobs
        sys.stdout.write("\n")
    if prompt_logprobs:
        print_logprobs("prompt", prompt_logprobs)
    if logprobs:
        print_logprobs("generated", logprobs)
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.strip().strip("[]").replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    from shardserve import __version__

    parser = argparse.ArgumentParser(prog="shardserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompt-token-ids", type=_token_ids, default=None, metavar="IDS",
                     help="the prompt as token ids, comma-separated (1,2,3) or a JSON list: for models without a "
                     "tokenizer (built-in configs with --load-format dummy)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    # --seed is the engine's (as vLLM's); a request seed of its own is --request-seed. Logprobs go to stderr.
    add_sampling_args(gen, renamed={"seed": "request-seed"})
    gen.set_defaults(func=cmd_generate)
    add_bench_parser(sub)
    add_cluster_parsers(sub)
    add_client_parser(sub)
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
