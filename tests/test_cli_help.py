"""Every command's --help names each flag with a help line and its default (vLLM users read defaults there)."""

from __future__ import annotations

import argparse
import re

from shardserve.cli.main import build_parser
from shardserve.cli.flags import engine_kwargs, sampling_kwargs


def _commands(parser: argparse.ArgumentParser, path: str = "shardserve"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}")


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    missing = []
    commands = list(_commands(build_parser()))
    assert {"shardserve generate", "shardserve serve", "shardserve client", "shardserve bench offline"} <= {
        path for path, _ in commands}
    for path, parser in commands:
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), path
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if action.help == argparse.SUPPRESS:
                continue  # hidden old spellings
            if not action.help:
                missing.append(f"{path} {action.option_strings or action.dest}: no help")
                continue
            shown = parser.formatter_class(prog=path)._get_help_string(action)
            if action.option_strings and "default" not in shown:
                missing.append(f"{path} {action.option_strings}: default not shown")
            if len(re.findall(r"\(default[ :]", shown)) > 1:  # "(default 4 MiB) (default: None)"
                missing.append(f"{path} {action.option_strings}: the default said twice: {shown}")
    assert not missing, "\n".join(missing)
    generate = dict(commands)["shardserve generate"].format_help()
    assert "(default: 128)" in generate and "(default: 0.0)" in generate  # --max-tokens, --temperature


def test_generate_takes_the_engine_seed_as_vllm_and_a_request_seed_of_its_own():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--seed", "3", "--request-seed", "9", "--logprobs", "2",
                              "--presence-penalty", "0.5", "--min-tokens", "2", "--prompt-logprobs", "1"])
    assert engine_kwargs(args)["seed"] == 3
    sampling = sampling_kwargs(args)
    assert (sampling["seed"], sampling["logprobs"], sampling["presence_penalty"], sampling["min_tokens"],
            sampling["prompt_logprobs"]) == (9, 2, 0.5, 2, 1)
    unset = parser.parse_args(["generate", "hi"])
    assert engine_kwargs(unset)["seed"] == 0 and sampling_kwargs(unset)["seed"] is None
    assert parser.parse_args(["bench", "offline", "--seed", "5"]).seed == 5  # the workload's seed is the engine's
