"""shardserve.client.clients against a real controller and gRPC server (no Ray): the default model at TP=1 in process,
the controller on an event loop of its own thread, as a Ray actor would run it.

Proves: health is NOT_SERVING (and Generate UNAVAILABLE) until the engine has loaded; a stream's deltas add up to
the generate() result; chat applies the template; logprobs, abort by id, deadlines (the request is freed on the
server), the async client, client-side argument checks, and that importing the client pulls in no torch.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import grpc
import pytest

from shardserve.client.clients import AsyncClient, Client
from shardserve.cluster.controller import ControllerConfig, ServedModel
from shardserve.settings.resolve import build_engine_config, model_facts
from shardserve.settings.engine_factory import EngineFactory
from tests.e2e._controller_thread import ControllerThread


class GatedExecutor:
    """Makes the in-process executor only once the test opens the gate: the engine is "loading" until then."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, config):
        from shardserve.worker.inprocess import InProcessExecutor

        assert self.gate.wait(120), "the test never opened the gate"
        return InProcessExecutor(config)


@pytest.fixture(scope="module")
def gated(default_model_dir):
    config = build_engine_config(model=default_model_dir, device="cpu", num_kv_blocks=64, max_model_len=512)
    facts = model_facts(config)
    executor = GatedExecutor()
    served = ControllerThread(ControllerConfig(
        engine=config,
        model=ServedModel("smollm2", facts.architecture, facts.vocab_size, facts.eos_token_ids, facts.bos_token_id),
        build_engine=EngineFactory(executor),
        port=0,
        metrics_port=0,
        name="test-replica",
    ))
    served.gate = executor.gate
    yield served
    executor.gate.set()
    served.close()


@pytest.fixture(scope="module")
def address(gated) -> str:
    gated.gate.set()
    assert gated.call(gated.controller.wait_ready(120))
    return gated.address


def test_health_is_not_serving_and_generate_unavailable_until_the_engine_has_loaded(gated):
    """Runs first (file order): the gate is still closed."""
    with Client(gated.address, timeout=30) as client:
        assert client.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hello", max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        gated.gate.set()
        client.wait_ready(timeout=120)
        assert client.health() == "SERVING"


def test_stream_deltas_add_up_to_the_generate_result(address):
    with Client(address, timeout=120) as client:
        result = client.generate("The capital of France is", request_id="r1", temperature=0, max_tokens=12,
                                 ignore_eos=True)
        stream = client.stream("The capital of France is", temperature=0, max_tokens=12, ignore_eos=True)
        deltas = list(stream)
    assert result.request_id == "r1" and result.replica == "test-replica/0"
    assert result.finish_reason == "length" and result.usage.completion_tokens == 12
    assert "Paris" in result.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids == stream.result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    assert stream.request_id and stream.request_id != "r1"


def test_chat_applies_the_models_template(address):
    with Client(address, timeout=120) as client:
        reply = client.chat([{"role": "user", "content": "What is the capital of France?"}], temperature=0,
                            max_tokens=16)
        plain = client.generate("What is the capital of France?", temperature=0, max_tokens=1)
    assert "Paris" in reply.text and reply.finish_reason == "stop"
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 5  # the template's role markers


def test_logprobs_and_prompt_logprobs_come_in_the_shape_llm_gives(address, default_model_dir):
    from shardserve import LLM, SamplingParams

    prompt = "The capital of France is"
    with Client(address, timeout=120) as client:
        result = client.generate(prompt, temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
        n_over_wire = client.stream(prompt, n=2)
        with pytest.raises(grpc.RpcError) as refused:
            list(n_over_wire)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a request makes one output" in refused.value.details()
    assert [next(iter(lp)) for lp in result.logprobs] == result.token_ids  # the sampled token first
    for lp, token in zip(result.logprobs, result.token_ids):
        assert lp[token].rank == 1 and len(lp) == 3  # greedy picks the best, which is among the top 3
        ranked = sorted(lp.values(), key=lambda e: e.rank)
        assert [e.rank for e in ranked] == [1, 2, 3] and ranked[0].logprob >= ranked[1].logprob >= ranked[2].logprob
    assert result.logprobs[0][result.token_ids[0]].decoded_token == " Paris"
    with LLM(default_model_dir) as llm:
        ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
                            use_tqdm=False)[0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(ours.prompt_token_ids)
    for got, want in zip(result.prompt_logprobs[1:] + result.logprobs,
                         ours.prompt_logprobs[1:] + ours.outputs[0].logprobs):
        assert list(got) == list(want)
        for token in got:
            assert got[token].rank == want[token].rank and got[token].decoded_token == want[token].decoded_token
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)


def test_abort_by_id_ends_the_stream_with_finish_reason_abort(address):
    with Client(address, timeout=120) as client:
        stream = client.stream("Tell me a long story", request_id="to-abort", temperature=0, max_tokens=400,
                               ignore_eos=True)
        deltas = iter(stream)
        next(deltas)
        client.abort("to-abort")
        rest = list(deltas)
        assert stream.result.finish_reason == "abort" and len(stream.result.token_ids) < 400
        assert sum(len(d.token_ids) for d in rest) < 400
        with pytest.raises(grpc.RpcError) as error:
            client.abort("to-abort")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_deadline_exceeded_aborts_the_request_on_the_server(address):
    with Client(address, timeout=120) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate("Count to a thousand:", temperature=0, max_tokens=400, ignore_eos=True, timeout=0.5)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 60
        while (stats := client.server_stats()).num_running or stats.kv_blocks_used:
            assert time.monotonic() < deadline, f"the expired request still runs: {stats}"
            time.sleep(0.1)


def test_async_client_gives_the_blocking_clients_results(address):
    async def run():
        async with AsyncClient(address, timeout=120) as client:
            health = await client.health()
            info = await client.model_info()
            result = await client.generate("One, two, three,", temperature=0, max_tokens=6)
            stream = client.stream("One, two, three,", temperature=0, max_tokens=6)
            streamed = [t async for d in stream for t in d.token_ids]
            return health, info, result, streamed, await client.server_stats()

    health, info, result, streamed, stats = asyncio.run(run())
    with Client(address, timeout=120) as client:
        blocking = client.generate("One, two, three,", temperature=0, max_tokens=6)
    assert health == "SERVING" and info.model == "smollm2" and info.tensor_parallel_size == 1
    assert result.token_ids == streamed == blocking.token_ids
    assert stats.requests_finished >= 2 and stats.kv_blocks_used == 0


def test_client_side_argument_errors_raise_before_sending(address):
    with Client(address, timeout=30) as client:
        with pytest.raises(TypeError, match="temprature"):
            client.generate("hi", temprature=0)
        with pytest.raises(TypeError, match="prompt"):
            client.generate(42)


def test_importing_the_client_pulls_in_no_torch():
    code = "import sys, shardserve.client.clients; sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_requests_beyond_the_admission_limit_get_resource_exhausted_and_harm_no_one(gated, address):
    """With max_live_requests 2 and two streams running, a third request is refused with RESOURCE_EXHAUSTED;
    the two finish normally, and once they have, a new request is admitted again."""
    gated.controller.front.max_live_requests = 2
    try:
        with Client(address, timeout=120) as client:
            streams = [client.stream("Count slowly:", temperature=0, max_tokens=40, ignore_eos=True) for _ in range(2)]
            iterators = [iter(s) for s in streams]
            for it in iterators:
                next(it)  # both are live (admitted and generating)
            with pytest.raises(grpc.RpcError) as error:
                client.generate("One more", temperature=0, max_tokens=4)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit is 2" in error.value.details()
            for it, stream in zip(iterators, streams):
                list(it)
                assert stream.result.finish_reason == "length" and len(stream.result.token_ids) == 40
            deadline = time.monotonic() + 60
            while client.server_stats().num_running:  # the finished streams' requests leave the server
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert client.generate("One more", temperature=0, max_tokens=4).finish_reason == "length"
    finally:
        gated.controller.front.max_live_requests = 4096


def test_finished_reports_the_stop_string_or_stop_token_that_matched(address):
    with Client(address, timeout=120) as client:
        free = client.generate("The capital of France is", temperature=0, max_tokens=8, ignore_eos=True)
        word = free.text.split()[0]  # " Paris." -> "Paris."
        by_string = client.generate("The capital of France is", temperature=0, max_tokens=8, stop=[word])
        by_token = client.generate("The capital of France is", temperature=0, max_tokens=8,
                                   stop_token_ids=[free.token_ids[1]])
        by_length = client.generate("The capital of France is", temperature=0, max_tokens=2, ignore_eos=True)
    assert by_string.finish_reason == "stop" and by_string.stop_reason == word
    assert by_token.finish_reason == "stop" and by_token.stop_reason == str(free.token_ids[1])  # a string on the wire
    assert by_length.finish_reason == "length" and by_length.stop_reason is None


def test_metrics_have_vllms_names_types_and_the_model_name_label(gated, address):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with Client(address, timeout=120) as client:
        for _ in range(2):  # the second one finds the first one's prompt blocks in the prefix cache
            client.generate("The capital of France is a city that " * 4, temperature=0, max_tokens=3)
    metrics_address = gated.controller.metrics_address
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "shardserve:requests": "counter", "shardserve:prompt_tokens": "counter",
        "shardserve:generation_tokens": "counter", "shardserve:prefix_cache_queries": "counter",
        "shardserve:prefix_cache_hits": "counter", "shardserve:num_requests_waiting": "gauge",
        "shardserve:num_requests_running": "gauge", "shardserve:kv_cache_usage_perc": "gauge",
        "shardserve:kv_cache_blocks": "gauge", "shardserve:kv_cache_blocks_used": "gauge",
        "shardserve:kv_cache_blocks_cached": "gauge", "shardserve:engine_step_seconds": "histogram",
        "shardserve:e2e_request_latency_seconds": "histogram", "shardserve:request_queue_time_seconds": "histogram",
        "shardserve:time_to_first_token_seconds": "histogram", "shardserve:time_per_output_token_seconds": "histogram",
    }
    assert {name: families[name].type for name in expected if name in families} == expected
    samples = [s for f in families.values() for s in f.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert not [f.name for f in families.values() if f.type == "gauge" and f.name.endswith("_total")]
    assert all(s.labels.get("model_name") == "smollm2" for s in samples)  # as ServedModel names it
    value = {(s.name, s.labels.get("outcome")): s.value for s in samples}
    assert value[("shardserve:requests_total", "length")] >= 2
    assert value[("shardserve:prefix_cache_hits_total", None)] > 0
    assert value[("shardserve:prefix_cache_queries_total", None)] > value[("shardserve:prefix_cache_hits_total", None)]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds"):
        assert value[(f"shardserve:{name}_count", None)] >= 2, name
    assert 0 <= value[("shardserve:kv_cache_usage_perc", None)] <= 1


def test_final_only_answers_in_one_message_with_what_the_stream_gives(address):
    """final_only: Started, one Delta with every token, its text and logprobs, then Finished; the same greedy
    answer as the streamed request's, a stop string held back alike."""
    from shardserve.proto import generation_pb2 as pb
    from shardserve.proto import generation_pb2_grpc as pb_grpc

    prompt = "The capital of France is"
    with Client(address, timeout=120) as client:
        streamed = client.generate(prompt, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        stop = streamed.text.split()[2]
        stopped = client.generate(prompt, temperature=0, max_tokens=12, stop=[stop])
        whole = client.generate(prompt, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, final_only=True)
        whole_stopped = client.generate(prompt, temperature=0, max_tokens=12, stop=[stop], final_only=True)
    assert whole.token_ids == streamed.token_ids and whole.text == streamed.text
    assert [list(p) for p in whole.logprobs] == [list(p) for p in streamed.logprobs]
    assert whole_stopped.text == stopped.text and whole_stopped.stop_reason == stop == stopped.stop_reason
    assert stop not in whole_stopped.text

    with grpc.insecure_channel(address) as channel:
        messages = list(pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(text=prompt, temperature=0, max_tokens=12, ignore_eos=True, final_only=True),
            timeout=120))
    assert [m.WhichOneof("kind") for m in messages] == ["started", "delta", "finished"]
    assert list(messages[1].delta.token_ids) == streamed.token_ids and messages[1].delta.text == streamed.text
