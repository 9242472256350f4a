"""Sampling fields are listed once, in SamplingParams (cluster/sampling_params.py); the wire formats
(generation.proto, worker.proto) mirror them, and every Python mapping goes by field name: the CLI flags, the
client's keywords, the server's GenerateRequest -> SamplingParams and SamplingParams -> SamplingSpec."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from shardserve.client.clients import build_request
from shardserve.cluster.generation_service import request_from_proto
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cli.flags import CLI_SAMPLING_DEFAULTS, add_sampling_args, sampling_kwargs
from shardserve.proto.plan import SamplingSpec

NAMES = [f.name for f in fields(SamplingParams)]
GIVEN = dict(temperature=0.5, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
             frequency_penalty=-0.5, seed=42, max_tokens=30, min_tokens=3, stop=["END", "\n\n"],
             stop_token_ids=[5, 9], ignore_eos=True, logprobs=4, prompt_logprobs=2, skip_special_tokens=False,
             include_stop_str_in_output=True, final_only=True, n=1, best_of=1, logit_bias={3: -100.0, 9: 2.5},
             structured_outputs=None)  # (min_tokens excludes it: test_structured_outputs_travel_by_name)
API_ONLY = {f.name for f in fields(SamplingParams) if not f.metadata["cli"]}  # no flag: n, best_of, structured_outputs


def parse(*argv: str, exclude=()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sampling_args(parser, exclude=exclude)
    return parser.parse_args(list(argv))


def test_the_example_sets_every_field():
    assert set(GIVEN) == set(NAMES)


def test_every_field_is_a_flag_with_its_default_and_help():
    assert all(f.metadata["help"] for f in fields(SamplingParams))
    unset = sampling_kwargs(parse())
    assert unset == {f.name: CLI_SAMPLING_DEFAULTS.get(f.name, f.default) for f in fields(SamplingParams)
                     if f.name not in API_ONLY}
    assert API_ONLY == {"n", "best_of", "structured_outputs"}
    assert (unset["max_tokens"], unset["temperature"]) == (128, 0.0)  # the command line's own defaults
    assert SamplingParams(**unset) == SamplingParams(max_tokens=128, temperature=0.0)
    assert "logprobs" not in sampling_kwargs(parse(exclude=("logprobs",)))


def test_flags_parse_to_the_values_they_name():
    args = parse("--temperature", "0.5", "--top-k", "7", "--top-p", "0.9", "--min-p", "0.05",
                 "--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
                 "--seed", "42", "--max-tokens", "30", "--min-tokens", "3", "--stop", "END", "--stop", "\n\n",
                 "--stop-token-ids", "5", "--stop-token-ids", "9", "--ignore-eos", "--logprobs", "4",
                 "--prompt-logprobs", "2", "--no-skip-special-tokens", "--include-stop-str-in-output",
                 "--final-only", "--logit-bias", "3=-100", "--logit-bias", " 9 = 2.5")
    assert sampling_kwargs(args) == {k: v for k, v in GIVEN.items() if k not in API_ONLY}
    for bad in ("3", "x=1", "3=y"):
        with pytest.raises(SystemExit):
            parse("--logit-bias", bad)


def test_client_keywords_reach_the_server_as_the_same_sampling_params():
    prompt, params, _ = request_from_proto(build_request("hi", None, dict(GIVEN)))
    assert prompt == "hi" and params == SamplingParams(**GIVEN)
    for name in NAMES:  # one at a time: the others take the server's defaults (max_tokens: the rest, None)
        one = request_from_proto(build_request([1], None, {name: GIVEN[name]}))[1]
        assert one == SamplingParams(**{"max_tokens": None, name: GIVEN[name]}), name
    assert request_from_proto(build_request([1], None, {"stop": "END"}))[1].stop == ["END"]


def test_the_client_checks_only_what_building_the_message_needs():
    with pytest.raises(TypeError, match="temprature"):
        build_request("hi", None, {"temprature": 0})
    with pytest.raises(TypeError, match="top_k: "):
        build_request("hi", None, {"top_k": "many"})  # protobuf cannot hold it
    msg = build_request("hi", None, {"temperature": -1.0, "max_tokens": 0})  # the server's to judge
    with pytest.raises(ValueError, match="temperature"):
        request_from_proto(msg)


def test_params_map_onto_the_workers_spec_by_name():
    spec = SamplingParams(**GIVEN).to_spec(eos_token_ids=[2, 5], default_seed=7)
    shared = {f.name for f in fields(SamplingSpec)} & set(NAMES) - {"seed", "logprobs", "prompt_logprobs",
                                                                      "stop_token_ids"}
    assert shared and all(getattr(spec, name) == GIVEN[name] for name in shared)
    assert (spec.seed, spec.logprobs, spec.stop_token_ids) == (42, 4, [5, 9])  # ignore_eos: no eos added
    assert spec.prompt_logprobs == 2
    default = SamplingParams().to_spec(eos_token_ids=[2], default_seed=7)
    assert default.logprobs == -1 == default.prompt_logprobs and default.stop_token_ids == [2] and default.seed == 7  # the engine's draw
    assert isinstance(SamplingParams(temperature=1).to_spec([], 0).temperature, float)


@pytest.mark.parametrize("prompt, sampling, field, says", [
    ("hi", {"max_tokens": 10**30}, "max_tokens", "max_tokens must be an integer in [-2**31, 2**31), got 1000000"),
    ("hi", {"seed": -1}, "seed", "seed must be an integer in [0, 2**64), got -1"),  # the range the request holds
    ([10**12], {}, "prompt", "prompt token ids must be integers in [-2**31, 2**31), got 1000000000000"),
    ("hi", {"logit_bias": {2**40: 1.0}}, "logit_bias", "logit_bias keys must be integers in [-2**31, 2**31)"),
    ("a\ud800b", {}, "prompt", "prompt is not valid UTF-8 text (surrogates not allowed at position 1)"),
    ([{"role": "user", "content": "\udcff"}], {}, "messages", "messages is not valid UTF-8 text"),
    ("hi", {"stop": ["ok", "\ud800"]}, "stop", "stop is not valid UTF-8 text"),
])
def test_a_value_the_request_cannot_hold_is_a_field_error_naming_the_field(prompt, sampling, field, says):
    """What protobuf refuses to hold (an integer beyond its field, a lone surrogate) is a ValueError naming the field
    (and the range of an integer field), which the gateway answers with 400 (not a 500 from an unexpected exception)."""
    from shardserve.client.clients import FieldError

    with pytest.raises(FieldError) as refused:
        build_request(prompt, None, sampling)
    assert refused.value.field == field and says in str(refused.value)
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize("spec", [{"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                                  {"regex": "[a-z]+"}, {"choice": ["x", "y z"]}, {"grammar": 'root ::= "a"'},
                                  {"json_object": True}])
def test_structured_outputs_travel_by_name(spec):
    """From the client's keyword (a dict or StructuredOutputsParams) to the server's SamplingParams and on to the
    workers' spec (grammar_kind, grammar)."""
    from shardserve import StructuredOutputsParams

    kind, text = StructuredOutputsParams(**spec).kind_and_text()
    for given in (spec, StructuredOutputsParams(**spec)):
        params = request_from_proto(build_request("hi", None, {"structured_outputs": given}))[1]
        assert params.structured_outputs.kind_and_text() == (kind, text)  # (a schema travels as its text)
        params.structured_outputs = None
        assert params == SamplingParams(max_tokens=None)
    worker = SamplingParams(structured_outputs=spec).to_spec([2], 0)
    assert (worker.grammar_kind, worker.grammar) == (kind, text) and kind == next(iter(spec))
