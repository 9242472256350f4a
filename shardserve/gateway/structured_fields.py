"""The request fields that ask for structured outputs, -> the gRPC GenerateRequest's structured_outputs (a dict of
one of json, regex, choice, grammar, json_object):

- OpenAI's `response_format` (chat): {"type": "text"} (nothing), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}} (strict or not, the schema is enforced);
- vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and its older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (completions and chat).

At most one of them may be given; a malformed one is a 400 naming the field. Whether a schema, regex or grammar
compiles is the server's to judge (INVALID_ARGUMENT -> 400 with its reason).
"""

from __future__ import annotations

from typing import Any

from shardserve.gateway.unsupported import UnsupportedField

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def response_format_spec(response_format: dict | None) -> dict | None:
    """OpenAI's response_format -> a structured_outputs dict (None for text or absent)."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise UnsupportedField("response_format", "response_format json_schema needs {'json_schema': {'name': "
                                                      "..., 'schema': {...}}}")
        # no schema: any JSON object (as OpenAI's non-strict json_schema without one)
        return {"json": inner["schema"]} if inner.get("schema") else {"json_object": True}
    raise UnsupportedField("response_format", f"response_format type must be text, json_object or json_schema, "
                                              f"got {kind!r}")


def structured_outputs_of(body: Any, response_format: dict | None = None) -> dict | None:
    """The structured_outputs a request body asks for, from whichever one of its fields sets it; None if none."""
    found: list[tuple[str, dict]] = []
    spec = response_format_spec(response_format)
    if spec is not None:
        found.append(("response_format", spec))
    given = getattr(body, "structured_outputs", None)
    if given is not None:
        if not isinstance(given, dict) or not given or set(given) - set(SPEC_KEYS):
            raise UnsupportedField("structured_outputs", f"structured_outputs takes one of {', '.join(SPEC_KEYS)}")
        found.append(("structured_outputs", {k: v for k, v in given.items() if v is not None}))
    for field, key in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, {key: value}))
    if len(found) > 1:
        raise UnsupportedField(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: give one")
    return found[0][1] if found else None
