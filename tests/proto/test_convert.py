"""proto/convert.py: dataclass -> protobuf -> bytes -> protobuf -> dataclass gives back exactly what went in."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest

from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto import generation_pb2
from shardserve.proto import worker_pb2 as pb
from shardserve.proto.config import EngineConfig
from shardserve.proto.convert import (
    engine_config_from_proto,
    engine_config_to_proto,
    sampling_spec_from_proto,
    sampling_spec_to_proto,
    step_plan_from_proto,
    step_plan_to_proto,
    step_result_from_proto,
    step_result_to_proto,
)
from shardserve.proto.plan import NewRequest, PromptLogprobs, SamplingSpec, StepPlan, StepResult, TokenLogprobs


def _over_the_wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _random_spec(rng: random.Random) -> SamplingSpec:
    return SamplingSpec(
        temperature=rng.choice([0.0, rng.uniform(0, 2)]),
        top_k=rng.choice([0, rng.randrange(1, 100)]),
        top_p=rng.uniform(0.01, 1),
        min_p=rng.random(),
        repetition_penalty=rng.uniform(0.1, 3),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        seed=rng.getrandbits(63),
        logprobs=rng.choice([-1, 0, 5, 20]),
        min_tokens=rng.randrange(10),
        stop_token_ids=[rng.randrange(1 << 17) for _ in range(rng.randrange(4))],
        logit_bias={rng.randrange(1 << 17): rng.uniform(-100, 100) for _ in range(rng.randrange(4))},
    )


def _random_plan(rng: random.Random, step_id: int) -> StepPlan:
    new = [
        NewRequest(
            req_id=f"new-{step_id}-{i}",
            token_ids=[rng.randrange(1 << 17) for _ in range(rng.randrange(1, 300))],
            num_prompt_tokens=rng.randrange(1, 200),
            num_computed_tokens=16 * rng.randrange(5),
            block_ids=[rng.randrange(1 << 20) for _ in range(rng.randrange(1, 20))],
            sampling=_random_spec(rng),
        )
        for i in range(rng.randrange(4))
    ]
    running = [f"run-{i}" for i in rng.sample(range(1000), rng.randrange(50))]
    req_ids = [r.req_id for r in new] + running
    return StepPlan(
        step_id=step_id,
        new_requests=new,
        req_ids=req_ids,
        num_tokens=[rng.randrange(1, 512) for _ in req_ids],
        new_block_ids={r: [rng.randrange(1 << 20), rng.randrange(1 << 20)] for r in running if rng.random() < 0.2},
        finished_req_ids=[f"done-{i}" for i in range(rng.randrange(3))],
        preempted_req_ids=[f"pre-{i}" for i in range(rng.randrange(3))],
    )


def _random_result(rng: random.Random, step_id: int, logprob_share: float) -> StepResult:
    req_ids = [f"r{i}" for i in range(rng.randrange(1, 64))]
    logprobs: list[TokenLogprobs | None] = []
    for _ in req_ids:
        top_n = rng.choice([0, 1, 5, 20])  # 0: only the sampled token's logprob was asked for
        asked = rng.random() < logprob_share
        logprobs.append(
            TokenLogprobs(
                logprob=-rng.expovariate(1.0),
                top_ids=[rng.randrange(1 << 17) for _ in range(top_n)],
                top_logprobs=[-rng.expovariate(1.0) for _ in range(top_n)],
                rank=rng.randrange(1, 1 << 17),
            )
            if asked
            else None
        )
    prompt_logprobs = [
        PromptLogprobs(f"r{i}", rng.randrange(1, 500),
                       [TokenLogprobs(-rng.expovariate(1.0), [7] * n, [-1.0] * n, rng.randrange(1, 9)) for _ in range(k)])
        for i, (n, k) in enumerate([(0, 3), (2, 1), (5, 40)][: rng.randrange(4)])
    ]
    return StepResult(
        step_id=step_id,
        req_ids=req_ids,
        token_ids=[rng.randrange(1 << 17) for _ in req_ids],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        forward_ms=rng.uniform(0, 50),
    )


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_round_trip_exactly(seed):
    rng = random.Random(seed)
    plan = _random_plan(rng, step_id=rng.randrange(1, 1 << 40))
    assert step_plan_from_proto(_over_the_wire(step_plan_to_proto(plan))) == plan


def test_plan_with_every_field_set_round_trips():
    spec = SamplingSpec(0.7, 40, 0.9, 0.05, 1.1, 0.5, -0.5, (1 << 63) - 1, 20, 3, [2, 7], 5)
    plan = StepPlan(
        step_id=7,
        new_requests=[NewRequest("a", [1, 2, 3], 2, 0, [4], spec)],
        req_ids=["a", "b"],
        num_tokens=[3, 1],
        new_block_ids={"b": [9, 10]},
        finished_req_ids=["c"],
        preempted_req_ids=["d"],
    )
    decoded = step_plan_from_proto(_over_the_wire(step_plan_to_proto(plan)))
    assert decoded == plan
    assert decoded.num_batched_tokens == 4


def test_empty_plan_round_trips():
    assert step_plan_from_proto(_over_the_wire(step_plan_to_proto(StepPlan(step_id=1)))) == StepPlan(step_id=1)


@pytest.mark.parametrize("logprob_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(5))
def test_random_results_round_trip_exactly(seed, logprob_share):
    rng = random.Random(seed)
    result = _random_result(rng, step_id=seed + 1, logprob_share=logprob_share)
    wire = _over_the_wire(step_result_to_proto(result, rank=0))
    assert step_result_from_proto(wire) == result
    assert wire.rank == 0 and wire.error == ""


def test_result_without_logprobs_decodes_to_one_none_per_request():
    result = StepResult(step_id=3, req_ids=["a", "b"], token_ids=[5, 6], logprobs=[], forward_ms=1.5)
    decoded = step_result_from_proto(_over_the_wire(step_result_to_proto(result)))
    assert decoded.logprobs == [None, None]
    assert (decoded.req_ids, decoded.token_ids, decoded.forward_ms) == (["a", "b"], [5, 6], 1.5)


def test_acknowledgement_from_another_rank_carries_rank_and_error():
    wire = _over_the_wire(step_result_to_proto(StepResult(step_id=9), rank=2, error="stale step id 9, expected 11"))
    assert (wire.step_id, wire.rank, wire.error) == (9, 2, "stale step id 9, expected 11")
    assert step_result_from_proto(wire) == StepResult(step_id=9)


def test_logprobs_with_mismatched_top_lists_are_refused():
    bad = StepResult(step_id=1, req_ids=["a"], token_ids=[1], logprobs=[TokenLogprobs(-1.0, [1, 2], [-1.0])])
    with pytest.raises(ValueError, match="top ids"):
        step_result_to_proto(bad)


@pytest.mark.parametrize("seed", range(5))
def test_sampling_specs_round_trip_exactly(seed):
    spec = _random_spec(random.Random(seed))
    assert sampling_spec_from_proto(_over_the_wire(sampling_spec_to_proto(spec))) == spec


def test_default_sampling_spec_round_trips():
    # proto3's zero defaults differ from the dataclass's (top_p=1, logprobs=-1): the conversion must carry them.
    assert sampling_spec_from_proto(_over_the_wire(sampling_spec_to_proto(SamplingSpec()))) == SamplingSpec()


def test_engine_config_round_trips_with_and_without_optional_fields():
    plain = EngineConfig(model="/models/tiny")
    assert engine_config_from_proto(_over_the_wire(engine_config_to_proto(plain))) == plain
    full = EngineConfig(
        model="/models/tiny",
        tokenizer="/models/tok",
        tensor_parallel_size=3,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        block_size=32,
        num_kv_blocks=128,
        kv_cache_memory_gb=1.5,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=1234,
        dist_timeout_s=12.5,
    )
    assert engine_config_from_proto(_over_the_wire(engine_config_to_proto(full))) == full


def test_wire_messages_cover_every_dataclass_field():
    # A field added to a dataclass without its proto field would be dropped silently between processes.
    assert {f.name for f in fields(EngineConfig)} == set(pb.EngineConfig.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(SamplingSpec)} == set(pb.SamplingSpec.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(NewRequest)} == set(pb.NewRequest.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(StepPlan)} == set(pb.StepPlan.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(StepResult)} | {"rank", "error"} == set(pb.StepResult.DESCRIPTOR.fields_by_name)


def test_generate_request_carries_every_sampling_param():
    request_fields = set(generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    missing = {f.name for f in fields(SamplingParams)} - request_fields
    assert not missing, f"GenerateRequest lacks SamplingParams fields {missing}"
