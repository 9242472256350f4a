"""Property: whatever mix of valid and invalid requests, cancellations and deadlines clients send, every call ends
in a result or the right status, a valid greedy stream running alongside gives transformers' tokens, and the KV
blocks return to zero. Driven by hypothesis against the real server (the tiny model in-process behind the real
controller and gRPC on 127.0.0.1). Profiles: "ci" (the default: 30 examples) and "soak"
(SHARDSERVE_FUZZ_PROFILE=soak: many more)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shardserve.client.clients import AsyncClient, Client  # noqa: E402
from shardserve.cluster.api_security import ApiSecurity  # noqa: E402
from tests.e2e.test_client_security import _serve  # noqa: E402
from tests.hf_reference import assert_greedy_match, hf_greedy  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("soak", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("SHARDSERVE_FUZZ_PROFILE", "ci")

VOCAB, MAX_MODEL_LEN = 384, 256  # the tiny model's and e2e_config's
ALONGSIDE, ALONGSIDE_TOKENS = [1, 30, 60, 90, 120], 24

valid = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    "max_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0.0, 0.7, 1.3]),
    "seed": st.one_of(st.none(), st.integers(0, 2**31)),
})
invalid = st.one_of(
    st.fixed_dictionaries({"prompt": st.lists(st.integers(VOCAB, 10**6), min_size=1, max_size=4), "max_tokens": st.just(4)}),
    st.fixed_dictionaries({"prompt": st.just([]), "max_tokens": st.just(4)}),
    st.fixed_dictionaries({"prompt": st.just([1, 2]), "max_tokens": st.integers(MAX_MODEL_LEN, 10**5)}),
    st.fixed_dictionaries({"prompt": st.just([1, 2]), "max_tokens": st.just(2), "temperature": st.floats(-10, -0.01)}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20), "max_tokens": st.just(2)}),  # no tokenizer
    st.fixed_dictionaries({"raw": st.binary(min_size=1, max_size=40)}),  # maybe not a protobuf at all
)
request = st.tuples(st.one_of(valid, invalid), st.sampled_from(["run", "cancel", "deadline"]))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, e2e_config):
    served = _serve(e2e_config, tiny_llama_dir, ApiSecurity())
    yield served
    served.close()


@pytest.fixture(scope="module")
def alongside_reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, [ALONGSIDE], ALONGSIDE_TOKENS)[0]


async def _one(client: AsyncClient, address: str, spec: dict, behaviour: str):
    """"ok", or the status code name the call ended with."""
    if "raw" in spec:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream("/shardserve.v1.Generation/Generate")(spec["raw"], timeout=60)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return "ok"  # bytes that happened to be a valid request
    sampling = {k: v for k, v in spec.items() if k != "prompt" and v is not None}
    try:
        if behaviour == "cancel":
            stream = client.stream(spec["prompt"], ignore_eos=True, timeout=60, **sampling)
            async for _ in stream:
                break  # leaving the loop cancels the call
            return "cancelled"
        timeout = 0.05 if behaviour == "deadline" else 60
        result = await client.generate(spec["prompt"], ignore_eos=True, timeout=timeout, **sampling)
        assert result.usage.completion_tokens == spec["max_tokens"]
        return "ok"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    except (ValueError, TypeError):  # the client refuses what cannot be a message (e.g. an id past int64)
        return "client-refused"


def _expected(spec: dict, behaviour: str) -> set[str]:
    if "raw" in spec:
        return {"INVALID_ARGUMENT", "ok"}
    bad = (not spec["prompt"] or isinstance(spec["prompt"], str) or max(spec["prompt"]) >= VOCAB
           or spec["max_tokens"] + len(spec["prompt"]) > MAX_MODEL_LEN or spec.get("temperature", 0) < 0)
    allowed = {"INVALID_ARGUMENT", "client-refused"} if bad else {"ok"}
    if behaviour == "cancel":
        allowed |= {"cancelled"}
    if behaviour == "deadline":
        allowed |= {"DEADLINE_EXCEEDED"}
    return allowed


@settings.get_profile(PROFILE)
@given(requests=st.lists(request, min_size=1, max_size=12))
def test_every_call_ends_in_a_result_or_the_right_status_and_blocks_return_to_zero(server, alongside_reference,
                                                                                   requests):
    async def run():
        async with AsyncClient(server.address) as client:
            guarded = client.generate(ALONGSIDE, max_tokens=ALONGSIDE_TOKENS, temperature=0.0, ignore_eos=True,
                                      timeout=120)
            return await asyncio.gather(guarded, *(_one(client, server.address, spec, b) for spec, b in requests))

    alongside, *outcomes = asyncio.run(run())
    for (spec, behaviour), outcome in zip(requests, outcomes):
        assert outcome in _expected(spec, behaviour), (spec, behaviour, outcome)
    assert_greedy_match(alongside.token_ids, alongside_reference)
    with Client(server.address) as client:
        deadline = time.monotonic() + 30
        while (stats := client.server_stats(timeout=10)).kv_blocks_used or stats.num_running or stats.num_waiting:
            assert time.monotonic() < deadline, f"blocks not freed: {stats}"
            time.sleep(0.02)  # polling the server's counters, bounded by the deadline
