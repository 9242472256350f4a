"""Command-line flags derived from dataclass fields: the engine flags from EngineConfig's user settings
(proto/config.py), the sampling flags from SamplingParams (cluster/sampling_params.py). A flag's spelling is
`--` + the field name with dashes unless the field's metadata names others; its type, default and help come
from the field. `engine_kwargs` and `sampling_kwargs` read the parsed values back by field name.

A flag's form follows the field's type: a bool that defaults to False is a switch (`--enforce-eager`), one that
defaults to True is switched off (`--no-x`), or gets both where its flag names the on form
(`--[no-]enable-prefix-caching`), as an optional bool does (`--[no-]async-scheduling`);
a list is repeatable (`--stop a --stop b`).
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, Field, fields

from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig, user_default, user_settings

# The command line generates greedily and longer by default (SamplingParams: temperature 1.0, 16 tokens).
CLI_SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


def _kind(hint) -> tuple[type, bool]:
    """(the base type, whether None is allowed) of a field's type: `int | None` -> (int, True);
    `list[str] | str | None` -> (list[str], True)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _dest(f: Field, base) -> str:
    """The parsed value's name: the field's, except for a non-bool field whose flags are named otherwise, which
    keeps its last flag's name (`-tp/--tensor-parallel-size/--tp`: tp)."""
    flags = f.metadata.get("flags")
    if not flags or base is bool:
        return f.name
    return flags[-1].removeprefix("--").replace("-", "_")


def _add_flag(parser: argparse.ArgumentParser, f: Field, hint, default, flags=None, dest=None) -> None:
    base, optional = _kind(hint)
    flags = flags or f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
    help = f.metadata.get("help") or ""
    if default is not None and not isinstance(default, bool):
        help += " (default: %(default)s)"
    kwargs = dict(dest=dest or _dest(f, base), default=default, help=help)
    if dest and base is not bool:
        kwargs["metavar"] = f.name.upper()  # --request-seed SEED, not SAMPLING_SEED
    if base is bool:
        if optional or (default and not flags[0].startswith("--no-")):
            kwargs["action"] = argparse.BooleanOptionalAction  # --x / --no-x (vLLM's --[no-]enable-prefix-caching)
        else:
            kwargs["action"] = "store_false" if default else "store_true"
            kwargs["help"] = "turns off " + help if default else help
    elif typing.get_origin(base) is list:
        kwargs.update(action="append", type=typing.get_args(base)[0])
    elif typing.get_origin(base) is dict:  # --logit-bias 50256=-100 (repeatable): one entry a flag
        kwargs.update(action=_DictEntry, metavar="KEY=VALUE", type=_entry_parser(*typing.get_args(base)))
    else:
        kwargs.update(type=base, choices=f.metadata.get("choices"))
    parser.add_argument(*flags, **kwargs)
    for off in f.metadata.get("off_flags") or ():
        parser.add_argument(off, dest=kwargs["dest"], action="store_false", help=argparse.SUPPRESS)


def _entry_parser(key_type: type, value_type: type):
    def parse(text: str) -> tuple:
        key, sep, value = text.partition("=")
        try:
            if not sep:
                raise ValueError
            return key_type(key.strip()), value_type(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE ({key_type.__name__}={value_type.__name__}), "
                                             f"got {text!r}") from None
    return parse


class _DictEntry(argparse.Action):
    """Each use adds one KEY=VALUE entry to the flag's dict (None until the flag is given)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        entries = dict(getattr(namespace, self.dest) or {})
        entries[values[0]] = values[1]
        setattr(namespace, self.dest, entries)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig user setting, defaulting to the setting's user default; and vLLM's
    --trust-remote-code, accepted with a warning (nothing remote runs here)."""
    hints = typing.get_type_hints(EngineConfig)
    for name, f in user_settings().items():
        _add_flag(parser, f, hints[name], user_default(f))
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines, with a warning: no model's own code ever runs here")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings of parsed flags: build_engine_config(**engine_kwargs(args)), or LLM(**...)."""
    import sys

    from shardserve.settings.resolve import TRUST_REMOTE_CODE_NOTE

    if getattr(args, "trust_remote_code", False):
        print(f"shardserve: warning: --{TRUST_REMOTE_CODE_NOTE.replace('_', '-', 2)}", file=sys.stderr, flush=True)
    hints = typing.get_type_hints(EngineConfig)
    return {name: getattr(args, _dest(f, _kind(hints[name])[0])) for name, f in user_settings().items()}


def add_sampling_args(
    parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), renamed: dict[str, str] | None = None
) -> None:
    """One flag per SamplingParams field (but those excluded, and the API-only ones: n, best_of), with SamplingParams' defaults except the CLI's own
    (CLI_SAMPLING_DEFAULTS). renamed: field -> flag name where an engine flag has the field's (`generate`:
    the engine's --seed, the request's --request-seed); sampling_kwargs reads them back."""
    hints = typing.get_type_hints(SamplingParams)
    renamed = renamed or {}
    for f in fields(SamplingParams):
        if f.name not in exclude and f.metadata.get("cli", True):
            default = CLI_SAMPLING_DEFAULTS.get(f.name, None if f.default is MISSING else f.default)
            flag = renamed.get(f.name)
            _add_flag(parser, f, hints[f.name], default, flags=flag and ("--" + flag,),
                      dest=flag and "sampling_" + f.name)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The SamplingParams keywords of parsed flags (those add_sampling_args added)."""
    kwargs = {}
    for f in fields(SamplingParams):
        for dest in ("sampling_" + f.name, f.name):  # a renamed flag's value first (add_sampling_args)
            if hasattr(args, dest):
                kwargs[f.name] = getattr(args, dest)
                break
    return kwargs
