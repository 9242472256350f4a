"""The gateway's tool-call parsing and constraints (shardserve/gateway/tool_calls.py), and the chat template's view
of tools, tool calls and tool results (cluster/admission.py), without a server."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shardserve.cluster.admission import encode_prompt
from shardserve.gateway.tool_calls import ToolMode, parse_tool_calls, tool_mode, tool_schema
from shardserve.gateway.unsupported import UnsupportedField

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None, [("add", '{"a": 1, "b": 2}')]),
    ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": '
     '"{\\"b\\": 3}"}</tool_call>', "Sure.", [("add", '{"a": 1}'), ("add", '{"b": 3}')]),
    ('{"name": "add", "parameters": {"a": 5, "b": 6}}', None, [("add", '{"a": 5, "b": 6}')]),  # Llama 3.x
    ("Just text, no call.", "Just text, no call.", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_auto_parses_hermes_and_llama_calls_and_leaves_the_rest_as_content(text, content, calls):
    assert parse_tool_calls(ToolMode("auto"), text) == (content, calls)


def test_required_and_named_outputs_become_calls_that_their_schemas_admit():
    required = tool_schema(ToolMode("required"), [TOOL], parallel=False)
    output = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    jsonschema.validate(json.loads(output), required)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel_tool_calls
        jsonschema.validate(json.loads(output)[:1] * 2, required)
    assert parse_tool_calls(ToolMode("required"), output) == (None, [("add", '{"a": 1, "b": 2}')])
    assert tool_schema(ToolMode("named", "add"), [TOOL], None) == TOOL["function"]["parameters"]
    assert parse_tool_calls(ToolMode("named", "add"), '{"a": 1, "b": 2}') == (None, [("add", '{"a": 1, "b": 2}')])


def test_tool_choice_is_checked_against_the_tools():
    assert tool_mode([TOOL], None, None) == ToolMode("auto") and tool_mode([TOOL], "none", None) is None
    assert tool_mode([TOOL], {"type": "function", "function": {"name": "add"}}, None) == ToolMode("named", "add")
    with pytest.raises(UnsupportedField, match="not among the tools"):
        tool_mode([TOOL], {"type": "function", "function": {"name": "sub"}}, None)


TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.a }}{% endfor %}"
            "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}|{% endfor %}")


def test_the_chat_template_renders_tools_calls_and_tool_results(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = TEMPLATE
    text, ids = encode_prompt({"messages": [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}], "tools": [TOOL]}, tokenizer)
    assert text == "TOOLS:add;|user:1 + 2?|assistant:CALL add 1|tool:3 (for c1)|"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
