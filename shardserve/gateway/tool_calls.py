"""OpenAI tool calling in the gateway: `tools`, `tool_choice` ("none", "auto", "required", a named function) and
`parallel_tool_calls` -> what the request asks of the engine, and the model's text -> `message.tool_calls`.

- The chat template renders the tools (they travel with the chat: proto/request_fields.py, cluster/admission.py).
- "required" and a named function constrain the output with a JSON schema (structured outputs): a named function's
  output is its arguments object (the function's `parameters`); "required" makes a JSON list of
  {"name", "parameters"} calls, one of the tools' each (at most one where parallel_tool_calls is false).
- "auto" leaves the output free and parses it: Hermes / Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  blocks (the text around them stays the content), or a Llama 3.x JSON call `{"name": ..., "parameters": ...}` as
  the whole output. What does not parse stays content.
- Streamed, a choice with tools holds its text back until the end (a call cannot be told from content before it
  closes), then sends the content and one `delta.tool_calls` entry per call (index, id, type, name, arguments),
  as OpenAI's SDK accumulates them; finish_reason "tool_calls" when there are calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shardserve.gateway.openai_format import Choice, _dumps
from shardserve.gateway.unsupported import UnsupportedField

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "auto", "required" or "named"
    name: str | None = None  # named: the function


def tool_mode(tools: list[dict] | None, tool_choice, parallel: bool | None) -> ToolMode | None:
    """What tools and tool_choice ask for (None: no tool calls are parsed); UnsupportedField naming a bad field."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise UnsupportedField("tool_choice", "tool_choice needs tools")
    if not tools:
        return None
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type") != "function"
                or not isinstance(function.get("name"), str)):
            raise UnsupportedField("tools", f"tools[{i}]: a tool is {{'type': 'function', 'function': {{'name': ..., "
                                            "'parameters': {...}}}")
        if not isinstance(function.get("parameters", {}), dict):
            raise UnsupportedField("tools", f"tools[{i}]: parameters must be a JSON schema object")
        names.append(function["name"])
    if tool_choice in (None, "auto"):
        return ToolMode("auto")
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolMode("required")
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise UnsupportedField("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                                  f"the tools ({', '.join(names)})")
        return ToolMode("named", name)
    raise UnsupportedField("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', "
                                          "'function': {'name': ...}}")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_schema(mode: ToolMode, tools: list[dict], parallel: bool | None) -> dict | None:
    """The JSON schema a required or named tool choice constrains the output with (None for auto)."""
    if mode.kind == "named":
        return next(_parameters(t) for t in tools if t["function"]["name"] == mode.name)
    if mode.kind == "required":
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                             "parameters": _parameters(t)},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if parallel is False:
            schema["maxItems"] = 1
        return schema
    return None


def parse_tool_calls(mode: ToolMode, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(function name, arguments as JSON text)]) of a model's output."""
    if mode.kind == "named":
        return None, [(mode.name, text)]
    if mode.kind == "required":
        try:
            calls = json.loads(text)
            return None, [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        except (ValueError, KeyError, TypeError):
            return text, []  # cut short (length): the text as it is
    calls = []
    for block in _HERMES.findall(text):
        call = _call(block)
        if call is not None:
            calls.append(call)
    if calls:
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    call = _call(text.strip())  # Llama 3.x: the whole output is one JSON call
    if call is not None:
        return None, [call]
    return text, []


def _call(text: str) -> tuple[str, str] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolCallChoice(Choice):
    """A chat choice whose output may be tool calls: held back while streaming, parsed at the end."""

    def __init__(self, *args, tool_mode: ToolMode, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = tool_mode
        self.held: list[str] = []  # streaming: the text so far

    def _parsed(self, text: str) -> tuple[str | None, list[dict]]:
        content, calls = parse_tool_calls(self.mode, text)
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        if tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return content, tool_calls

    def delta_chunk(self, delta) -> bytes | None:
        self.held.append(delta.text)
        return None

    def last_chunk(self) -> bytes:
        content, calls = self._parsed("".join(self.held))
        chunks = b""
        if content:
            chunks += self._chunk(b',"delta":{"content":' + _dumps(content).encode() +
                                  b'},"logprobs":null,"finish_reason":null')
        for i, call in enumerate(calls):
            entry = {"index": i, **call}
            chunks += self._chunk(b',"delta":{"tool_calls":[' + _dumps(entry).encode() +
                                  b']},"logprobs":null,"finish_reason":null')
        return chunks + super().last_chunk()

    def body(self) -> dict:
        body = super().body()
        content, calls = self._parsed(body["message"]["content"])
        body["finish_reason"] = self.finish_reason
        body["message"]["content"] = content
        if calls:
            body["message"]["tool_calls"] = calls
        return body
