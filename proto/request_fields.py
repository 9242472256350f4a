"""The GenerateRequest fields that are messages of their own, to and from the Python values the client takes and
admission uses: structured_outputs (a StructuredOutputsParams or dict of its fields) and chat (messages with tool
calls, and the tools the chat template renders). The client (shardserve/client) and the server
(cluster/generation_service.py) both use these, so the two ends agree on the JSON fields."""

from __future__ import annotations

import json
from typing import Any

from shardserve.proto import generation_pb2 as pb


STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_message(value: Any):
    """A StructuredOutputsParams (or anything with its fields as attributes) or a dict of them -> the
    GenerateRequest's StructuredOutputs message (a schema given as a dict travels as its JSON text). Checks only
    what the message needs: exactly one field set, of a type it can hold (TypeError otherwise); the server judges
    the rest."""
    given = value if isinstance(value, dict) else {name: getattr(value, name, None) for name in STRUCTURED_FIELDS}
    unknown = sorted(set(given) - set(STRUCTURED_FIELDS))
    if unknown:
        raise TypeError(f"structured_outputs has no field(s) {', '.join(unknown)}; it takes {', '.join(STRUCTURED_FIELDS)}")
    set_ = {k: v for k, v in given.items() if v is not None and v is not False}
    if len(set_) != 1:
        raise TypeError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_FIELDS)}; got "
                        f"{', '.join(set_) or 'none'}")
    (name, v), = set_.items()
    if name == "json" and not isinstance(v, str):
        v = json.dumps(v)
    if name == "choice":
        return pb.StructuredOutputs(choice=pb.Choices(choices=list(v)))
    return pb.StructuredOutputs(**{name: v})


def structured_outputs_dict(msg) -> dict:
    """The StructuredOutputs message -> StructuredOutputsParams' fields (cluster/structured_outputs.py); {} when
    no kind is set (which that refuses by name)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return {}
    return {kind: list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)}


def chat_to_proto(prompt: Any, msg) -> None:
    """Chat messages (dicts: role, content, and an assistant's tool_calls or a tool's tool_call_id), or
    {"messages": [...], "tools": [...]}, into a GenerateRequest's ChatMessages `msg` (tool calls and tools as JSON)."""
    messages, tools = (prompt["messages"], prompt.get("tools")) if isinstance(prompt, dict) else (prompt, None)
    msg.messages.extend(pb.ChatMessage(
        role=m["role"], content=m.get("content") or "",
        tool_calls=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
        tool_call_id=m.get("tool_call_id") or "") for m in messages)
    if tools:
        msg.tools = json.dumps(tools)


def chat_from_proto(msg) -> Any:
    """ChatMessages -> chat messages as admission takes them: a list of dicts, or {"messages", "tools"} where the
    request carries tools. ValueError for JSON that does not parse."""
    messages = []
    for m in msg.messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            try:
                message["tool_calls"] = json.loads(m.tool_calls)
            except ValueError:
                raise ValueError("a chat message's tool_calls must be JSON") from None
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    if not messages:
        raise ValueError("chat must have at least one message")
    if not msg.tools:
        return messages
    try:
        tools = json.loads(msg.tools)
    except ValueError:
        raise ValueError("the chat's tools must be JSON") from None
    return {"messages": messages, "tools": tools}
