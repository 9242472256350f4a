"""Structured outputs through LLM on the default model: every output that ends with "stop" matches its schema,
regex, choice or grammar; unconstrained requests beside constrained ones keep their greedy tokens; a spec that
cannot compile is refused at admission, naming the problem, and harms nothing else."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from shardserve import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_schemas import random_schema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ARITHMETIC = 'root ::= num " " op " " num " = " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
ARITHMETIC_RE = r"[1-9][0-9]? [+*-] [1-9][0-9]? = [1-9][0-9]?"


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:
        yield engine


def _run(llm, prompt: str, spec: dict, **sampling):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec), **sampling)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_every_kind_of_spec_is_matched_and_ends_with_stop(llm):
    cases = [
        ("A person as JSON:", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("A US phone number:", {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
         lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t) or pytest.fail(t)),
        ("The capital of France is", {"choice": ["Paris", "Lyon", "Marseille"]},
         lambda t: t in ("Paris", "Lyon", "Marseille") or pytest.fail(t)),
        ("Some JSON:", {"json_object": True}, lambda t: json.loads(t)),
        ("A sum:", {"grammar": ARITHMETIC}, lambda t: re.fullmatch(ARITHMETIC_RE, t) or pytest.fail(t)),
    ]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(**spec))
              for _, spec, _ in cases]
    outputs = llm.generate([prompt for prompt, _, _ in cases], params, use_tqdm=False)
    for (prompt, spec, check), out in zip(cases, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (spec, completion.text)
        check(completion.text)
    assert outputs[2].outputs[0].text == "Paris"  # greedy among the choices: the model's own answer


def test_outputs_of_200_random_schemas_sampled_at_temperature_1_validate():
    """A property test: 200 generated schemas, one request each, sampled at temperature 1.0 in one batch; every
    output that ends with "stop" validates with jsonschema, and most of them do end so."""
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(200)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    with LLM(max_num_seqs=200) as engine:
        outputs = engine.generate(["JSON:"] * len(schemas), params, use_tqdm=False)
    stopped = 0
    for schema, out in zip(schemas, outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(completion.text), schema)
    assert stopped >= 150, f"only {stopped} of 200 outputs completed their schema"


def test_unconstrained_greedy_tokens_are_unchanged_beside_constrained_requests(llm):
    prompts = ["The capital of France is", "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = [SamplingParams(temperature=0.8, seed=1, max_tokens=12,
                                  structured_outputs=StructuredOutputsParams(json=PERSON)),
                   SamplingParams(temperature=0, max_tokens=12,
                                  structured_outputs=StructuredOutputsParams(regex="[a-z]{30}"))]
    mixed = llm.generate(["A person:", prompts[0], "Letters:", prompts[1]],
                         [constrained[0], plain, constrained[1], plain], use_tqdm=False)
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    letters = mixed[2].outputs[0]
    assert letters.finish_reason == "length" and re.fullmatch("[a-z]+", letters.text)  # cut short: "length"


@pytest.mark.parametrize("spec, says", [
    ({"json": {"type": "objekt"}}, "invalid json: Unsupported type \"objekt\""),
    ({"json": "{not json"}, "invalid json: the schema is not JSON"),
    ({"regex": "a(b"}, "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ({"grammar": "root ::= missing"}, "invalid grammar: EBNF parser error at line 1, column 10: Rule \"missing\""),
    ({"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(20_000))}, "over the limit of 65536"),
    ({"json": PERSON, "regex": "a"}, "exactly one of json, regex, choice, grammar, json_object; got json, regex"),
    ({"choice": []}, "choice must be a list of 1-1024 non-empty strings"),
])
def test_a_spec_that_cannot_compile_is_refused_at_admission_and_harms_nothing(llm, spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.generate(["hi", "hello"], [SamplingParams(max_tokens=2),
                                       SamplingParams(max_tokens=2, structured_outputs=spec)], use_tqdm=False)
    assert not llm.engines[0].has_unfinished()
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_settings_that_would_keep_a_grammar_from_ending_are_refused():
    with pytest.raises(ValueError, match="ignore_eos needs stop_token_ids"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=3, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="has no field"):
        SamplingParams(structured_outputs={"schema": {}})
    spec = SamplingParams(structured_outputs={"choice": ["a", "b"]}).to_spec([2], 0)
    assert (spec.grammar_kind, spec.grammar) == ("choice", '["a", "b"]')
