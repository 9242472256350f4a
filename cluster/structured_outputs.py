"""StructuredOutputsParams: what a request's output must match (vLLM's spelling: exactly one of json, regex, choice,
grammar, json_object), checked when SamplingParams is made and turned into the workers' (grammar_kind, grammar)
pair (proto/grammar.py says what each kind means). Whether the grammar compiles for the model's vocabulary is
checked at admission (Engine.admit; the server compiles it earlier, on its tokenizing pool), so a bad schema,
regex or grammar is refused before any step runs.

A constrained request ends when its grammar is complete: the mask then leaves only its stop tokens (the model's
eos and the request's stop_token_ids), and sampling one ends the request with finish_reason "stop". At max_tokens it
ends with "length" and the output is not claimed valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from shardserve.proto.grammar import MAX_CHOICES, MAX_GRAMMAR_BYTES


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (the output is one of these
    strings), grammar (an EBNF / GBNF grammar whose start rule is `root`), json_object=True (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.kind_and_text()  # raises ValueError for a malformed spec

    def kind_and_text(self) -> tuple[str, str]:
        """(grammar_kind, canonical text) for SamplingSpec; raises ValueError naming the problem."""
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"invalid json: the schema is not JSON ({e})") from None
            if not isinstance(value, dict):
                raise ValueError(f"invalid json: a JSON schema is an object, got {type(value).__name__}")
            text = json.dumps(value, separators=(",", ":"), sort_keys=True)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"json_object must be True, got {value!r}")
            text = ""
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"choice must be a list of 1-{MAX_CHOICES} non-empty strings")
            text = json.dumps(list(value), ensure_ascii=False)
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string")
            text = value
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the {kind} of structured_outputs is {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
        return kind, text


def as_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """A StructuredOutputsParams, or a dict of its fields (as JSON and the command line give it), or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(StructuredOutputsParams)})
        if unknown:
            raise ValueError(f"structured_outputs has no field(s) {', '.join(map(repr, unknown))}; it takes json, "
                             "regex, choice, grammar or json_object")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def compile_at_admission(params: Any, tokenizer_dir: str | None, vocab_size: int, tokenizer: Any = None) -> float:
    """Compiles a request's grammar for the model's vocabulary (cached by its text: a repeat costs a look-up), so
    that one that cannot compile is refused at admission. Returns the seconds it took; raises ValueError."""
    spec = params.structured_outputs
    if spec is None:
        return 0.0
    if tokenizer_dir is None:
        raise ValueError("structured_outputs needs the model's tokenizer; this model has none (token ids only)")
    from shardserve.proto.grammar import grammar_compiler

    kind, text = spec.kind_and_text()
    return grammar_compiler(tokenizer_dir, vocab_size, tokenizer).compile(kind, text).seconds
