"""Structured outputs over the wire: the gRPC client's structured_outputs, and the HTTP gateway's response_format,
structured_outputs and guided_* fields through the real `openai` package, against a controller serving the default
model in-process (no Ray: the wire paths are what is tested here). Proves: the output matches what was asked; the
openai SDK's `beta.chat.completions.parse` returns a parsed Pydantic object; a spec that cannot compile is
INVALID_ARGUMENT / 400 naming the problem at admission; the metrics count structured requests and compile times."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest

from shardserve.client.clients import Client
from shardserve.cluster.controller import ControllerConfig, ServedModel
from shardserve.gateway.app import GatewayThread
from shardserve.settings.engine_factory import EngineFactory
from shardserve.settings.resolve import build_engine_config, model_facts
from tests.e2e._controller_thread import ControllerThread

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


def _in_process(config):
    from shardserve.worker.inprocess import InProcessExecutor

    return InProcessExecutor(config)


@pytest.fixture(scope="module")
def served(default_model_dir):
    config = build_engine_config(model=default_model_dir, device="cpu", num_kv_blocks=128, max_model_len=512)
    facts = model_facts(config)
    controller = ControllerThread(ControllerConfig(
        engine=config,
        model=ServedModel("smollm2", facts.architecture, facts.vocab_size, facts.eos_token_ids, facts.bos_token_id),
        build_engine=EngineFactory(_in_process), port=0, metrics_port=0, name="structured"))
    try:
        assert controller.call(controller.controller.wait_ready(120))
        gateway = GatewayThread(controller.address, request_timeout_s=120)
        try:
            yield controller, gateway
        finally:
            gateway.stop()
    finally:
        controller.close()


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"http://{served[1].address}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def test_the_grpc_client_sends_structured_outputs(served):
    with Client(served[0].address, timeout=120) as client:
        out = client.generate("The capital of France is", max_tokens=8, temperature=0,
                              structured_outputs={"choice": ["Paris", "Nice"]})
        assert out.text == "Paris" and out.finish_reason == "stop"
        out = client.generate("A date:", max_tokens=16, temperature=1.0, seed=5,
                              structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.text) and out.finish_reason == "stop"
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("hi", max_tokens=4, structured_outputs={"regex": "(unclosed"})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid regex: Regex parsing error" in refused.value.details()


def test_response_format_json_schema_and_json_object(oai):
    answer = oai.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    answer = oai.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Any JSON object."}], max_tokens=60, temperature=0,
        response_format={"type": "json_object"})
    content = answer.choices[0].message.content
    assert content.startswith("{")  # (greedy may nest past max_tokens: "length" claims nothing more)
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_the_openai_sdks_parse_returns_the_pydantic_object(oai):
    completion = oai.beta.chat.completions.parse(
        model=None, messages=[{"role": "user", "content": "Name a city in France as JSON."}], max_tokens=60,
        temperature=0, response_format=City)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name and parsed.country


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'root ::= "a" | "b" "c"'}, lambda t: t in ("a", "bc")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
])
def test_vllms_extra_fields_constrain_completions(oai, extra, check):
    answer = oai.completions.create(model=None, prompt="Answer:", max_tokens=40, temperature=1.0, seed=3,
                                    extra_body=extra)
    assert answer.choices[0].finish_reason == "stop" and check(answer.choices[0].text), answer.choices[0].text


@pytest.mark.parametrize("body, param, says", [
    ({"guided_regex": "a(b"}, None, "invalid regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     None, 'invalid json: Unsupported type "objekt"'),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format type must be"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain the output"),
])
def test_a_bad_spec_is_a_400_naming_the_problem(oai, body, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    extra_body=body)
    assert says in refused.value.message
    if param is not None:
        assert refused.value.param == param


def test_metrics_count_structured_requests_and_compile_times(served, oai):
    oai.completions.create(model=None, prompt="Pick:", max_tokens=4, extra_body={"guided_choice": ["x", "y"]})
    text = served[0].controller.metrics.render().decode()
    count = re.search(r'^shardserve:structured_output_requests_total\{model_name="[^"]*"\} (\S+)', text, re.M)
    assert count and float(count.group(1)) >= 1
    compiles = re.search(r'^shardserve:grammar_compile_seconds_count\{model_name="[^"]*"\} (\S+)', text, re.M)
    assert compiles and float(compiles.group(1)) >= 1
    masks = re.search(r'^shardserve:grammar_mask_seconds_count\{model_name="[^"]*"\} (\S+)', text, re.M)
    assert masks and float(masks.group(1)) >= 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(oai):
    answer = oai.chat.completions.create(model=None, messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    _check_calls(message.tool_calls, [WEATHER, TIME])


def test_required_tool_calls_stream_as_the_sdk_accumulates_them(oai):
    kwargs = dict(model=None, messages=ASK, max_tokens=60, temperature=0, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kwargs).choices[0].message
    _check_calls(whole.tool_calls, [WEATHER, TIME])
    assert len(whole.tool_calls) == 1
    calls, reasons = {}, []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for part in choice.delta.tool_calls or ():
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_a_tool_result_goes_back_through_the_template(oai):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    answer = oai.chat.completions.create(model=None, messages=history, max_tokens=8, temperature=0,
                                         tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > 30  # the tool message and the call were rendered


@pytest.mark.parametrize("kwargs, param, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]: a tool is"),
])
def test_bad_tools_are_a_400_naming_the_field(oai, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=None, messages=ASK, max_tokens=4, **kwargs)
    assert refused.value.param == param and says in refused.value.message
