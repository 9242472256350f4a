"""The OpenAI-compatible HTTP gateway as users meet it: the real `openai` package against `shardserve serve
--http-port` (a separate process joining the session's Ray on loopback, the default model at TP=1 on CPU), and
against a fake gRPC upstream that answers each status code on demand.

Proves: /v1/models lists GetModelInfo's name; greedy completions and chat through the gateway equal the gRPC
client's output, streamed or not; token-id prompts, several prompts, stop strings, logprobs, seeds and usage
(stream_options.include_usage) map onto the gRPC request; invalid requests get 400 naming the field (ours and the
server's INVALID_ARGUMENT), n=2 and other unsupported fields 400, an unknown model 404, gRPC statuses their HTTP
codes (429, 503, 504, also in mid-stream); the Authorization header reaches the server as gRPC metadata; a client
that disconnects mid-stream frees its KV blocks on the server; SIGTERM drains (health 503) and stops the gateway.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardserve.client import Client
from shardserve.gateway import GatewayThread
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc
from tests.e2e.test_serve_cli import ServeProcess

GATEWAY_READY = re.compile(r"shardserve gateway ready: (http://\S+/v1)")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(ray_session, default_model_dir):
    """(serve process, gRPC address, gateway base URL)."""
    ray_port = ray_session.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    server = ServeProcess([
        "--model", default_model_dir, "--device", "cpu", "--tp", "1", "--num-kv-blocks", "64",
        "--max-model-len", "512", "--port", "0", "--ray-address", f"127.0.0.1:{ray_port}", "--drain-timeout", "30",
        "--http-port", "0",
    ])
    try:
        address = server.wait_ready(180)
        deadline = time.monotonic() + 30
        while not (match := GATEWAY_READY.search(_next_line(server, deadline))):
            pass
        yield server, address, match.group(1)
    finally:
        server.stop()


def _next_line(server: ServeProcess, deadline: float) -> str:
    while time.monotonic() < deadline:
        try:
            return server.stdout.get(timeout=0.5)
        except queue.Empty:
            assert server.proc.poll() is None, f"serve exited:\n{''.join(server.stderr)[-3000:]}"
    raise AssertionError("no gateway ready line")


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    client = openai.OpenAI(base_url=served[2], api_key="not-checked-yet", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(served) -> Client:
    with Client(served[1], timeout=120) as client:
        yield client


def _wait_idle(client: Client, timeout_s: float = 30) -> pb.ServerStats:
    deadline = time.monotonic() + timeout_s
    while (stats := client.server_stats()).num_running or stats.num_waiting or stats.kv_blocks_used:
        assert time.monotonic() < deadline, f"the server still holds requests: {stats}"
        time.sleep(0.02)
    return stats


def test_models_lists_the_name_get_model_info_reports(oai, grpc_client):
    models = oai.models.list().data
    assert [m.id for m in models] == [grpc_client.model_info().model]


def test_greedy_completion_equals_the_grpc_clients_output_streamed_or_not(oai, grpc_client):
    expected = grpc_client.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    got = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, temperature=0, max_tokens=12,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text and "Paris" in got.choices[0].text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    assert got.usage.total_tokens == expected.usage.prompt_tokens + 12
    chunks = list(oai.completions.create(prompt=PROMPT, model=got.model, temperature=0, max_tokens=12, stream=True,
                                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_greedy_chat_equals_the_grpc_clients_chat_streamed_or_not(oai, grpc_client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    expected = grpc_client.chat(messages, temperature=0, max_tokens=10)
    model = oai.models.list().data[0].id
    got = oai.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=10)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == expected.text
    assert got.usage.completion_tokens == expected.usage.completion_tokens
    assert got.choices[0].finish_reason == expected.finish_reason
    chunks = list(oai.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=10,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == expected.usage.completion_tokens
    assert usage.usage.prompt_tokens == expected.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(oai, grpc_client):
    """OpenAI's default for chat: no limit but the context. The answer ends by itself ("stop"), well within it."""
    got = oai.chat.completions.create(model=oai.models.list().data[0].id, temperature=0,
                                      messages=[{"role": "user", "content": "What is 2+2? Answer with one number."}])
    assert got.choices[0].finish_reason == "stop" and "4" in got.choices[0].message.content
    assert got.usage.completion_tokens > 0


def test_token_id_prompts_and_several_prompts_give_one_choice_each(oai, grpc_client, default_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(PROMPT, add_special_tokens=False)
    reference = grpc_client.generate(PROMPT, temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.text
    model = oai.models.list().data[0].id
    by_ids = oai.completions.create(model=model, prompt=ids, temperature=0, max_tokens=6,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert by_ids.choices[0].text == expected and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].token_ids == reference.token_ids  # vLLM's extension: the output's ids too
    batch = oai.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"], temperature=0, max_tokens=6,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == expected
    assert batch.usage.completion_tokens == 12
    chunks = list(oai.completions.create(model=model, prompt=[ids, ids], temperature=0, max_tokens=6, stream=True,
                                         extra_body={"ignore_eos": True}))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == expected


def test_stop_strings_end_the_text_before_them(oai, grpc_client):
    full = grpc_client.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True).text  # " Paris.\n\n..."
    assert "." in full
    got = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, temperature=0, max_tokens=12,
                                 stop=["."])
    assert got.choices[0].text == full.split(".")[0] and got.choices[0].finish_reason == "stop"


def test_logprobs_of_completions_and_chat(oai):
    model = oai.models.list().data[0].id
    got = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and top[token] == pytest.approx(logprob)  # greedy: the best is taken
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert bytes(content[0].bytes).decode() == content[0].token
    streamed = list(oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0, max_tokens=4, logprobs=True, top_logprobs=3,
                                                stream=True))
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_a_seed_makes_sampling_repeatable_and_equal_to_the_grpc_clients(oai, grpc_client):
    model = oai.models.list().data[0].id
    texts = {oai.completions.create(model=model, prompt="Once upon a time", temperature=1.0, seed=1234,
                                    max_tokens=10).choices[0].text for _ in range(2)}
    assert texts == {grpc_client.generate("Once upon a time", temperature=1.0, seed=1234, max_tokens=10).text}


def test_invalid_requests_get_400_naming_the_field(oai):
    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as error:  # the server's INVALID_ARGUMENT, with its reason
        oai.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert error.value.status_code == 400 and "temperature" in error.value.message
    assert error.value.body["param"] == "temperature"
    assert error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as error:  # a field OpenAI does not have
        oai.completions.create(model=model, prompt=PROMPT, extra_body={"frobnicate": 1})
    assert error.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as error:  # shapes pydantic refuses
        oai.completions.create(model=model, prompt=[[1, 2], "text"])
    assert error.value.body["param"] == "prompt" and "token ids" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    assert error.value.body["param"] == "messages.0.role"
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("logit_bias", {"1": 5}),
                         ("response_format", {"type": "json_object"})):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                        **{field: value})
        assert error.value.body["param"] == field
    # harmless OpenAI fields are accepted and ignored
    ok = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    user="someone", metadata={"k": "v"}, store=False)
    assert ok.usage.completion_tokens <= 2


def test_n_above_1_gets_400(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=oai.models.list().data[0].id, n=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["param"] == "n" and "n must be 1" in error.value.message


def test_an_unknown_model_gets_404(oai):
    with pytest.raises(openai.NotFoundError) as error:
        oai.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"


def test_a_client_that_disconnects_mid_stream_frees_its_blocks_on_the_server(oai, grpc_client):
    _wait_idle(grpc_client)
    stream = oai.completions.create(model=oai.models.list().data[0].id, prompt="Tell me a long story", max_tokens=300,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stats = grpc_client.server_stats()
    assert stats.num_running == 1 and stats.kv_blocks_used > 0  # still generating: the client has not left yet
    aborted = stats.requests_aborted
    stream.close()
    stats = _wait_idle(grpc_client)
    assert stats.requests_aborted == aborted + 1
    metrics = httpx.get(str(oai.base_url).removesuffix("/v1/") + "/metrics").text
    assert re.search(r"shardserve_gateway_client_disconnects_total ([1-9])", metrics)


def test_a_second_gateway_with_a_deadline_answers_504_and_the_server_frees_the_request(served, grpc_client):
    gateway = GatewayThread(served[1], "127.0.0.1", 0, request_timeout_s=0.5)
    try:
        with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as error:
                client.completions.create(model=client.models.list().data[0].id, prompt="Tell me a long story",
                                          max_tokens=300, extra_body={"ignore_eos": True})
            assert error.value.status_code == 504 and error.value.body["code"] == "deadline_exceeded"
        _wait_idle(grpc_client)
    finally:
        gateway.stop()


def test_sigterm_drains_health_turns_503_and_the_gateway_stops_with_serve(served):
    """The last test of the served server: it stops it."""
    server, _, base = served
    root = base.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (reply := _get(f"{root}/health")) is not None and reply.status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if reply is not None:  # draining (the gateway stops once the drain is over)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable_error"
    assert server.proc.wait(60) == 0
    assert _get(f"{root}/health") is None  # nothing listens there any more


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None


# ---- against a fake upstream: every status code, mid-stream errors, metadata --------------------------------
class FakeGeneration(pb_grpc.GenerationServicer):
    """The prompt text names the outcome: a gRPC status code to abort with (before the stream starts), or
    "MIDSTREAM_<CODE>" (after one delta). Anything else: "ok" in one delta."""

    def __init__(self) -> None:
        self.metadata: list[dict] = []

    def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        name = request.text
        if name in grpc.StatusCode.__members__:
            context.abort(grpc.StatusCode[name], f"fake {name}")
        yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id=request.request_id,
                                                                      prompt_token_count=3))
        yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text="ok", token_ids=[7]))
        if name.startswith("MIDSTREAM_"):
            context.abort(grpc.StatusCode[name.removeprefix("MIDSTREAM_")], "cut off")
        yield pb.GenerateResponse(finished=pb.GenerateResponse.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=1)))

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="fake", max_model_len=64, block_size=16)

    def GetServerStats(self, request, context):
        return pb.ServerStats(kv_blocks_total=8)


@pytest.fixture(scope="module")
def fake():
    """(fake servicer, its health servicer, a gateway in front of it, the fake's gRPC address)."""
    server = grpc.server(ThreadPoolExecutor(4))
    servicer, health_servicer = FakeGeneration(), health.HealthServicer()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    gateway = GatewayThread(f"127.0.0.1:{port}", "127.0.0.1", 0)
    try:
        yield servicer, health_servicer, f"http://{gateway.address}", f"127.0.0.1:{port}"
    finally:
        gateway.stop()
        server.stop(None)


@pytest.mark.parametrize("code,status", [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429),
                                         ("UNAVAILABLE", 503), ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_statuses_become_their_http_codes_with_openai_error_bodies(fake, code, status, stream):
    reply = httpx.post(f"{fake[2]}/v1/completions", json={"prompt": code, "stream": stream}, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] == f"fake {code}"


def test_an_error_after_the_stream_began_arrives_as_its_last_event(fake):
    with openai.OpenAI(base_url=f"{fake[2]}/v1", api_key="x", max_retries=0) as client:
        stream = client.completions.create(model="fake", prompt="MIDSTREAM_UNAVAILABLE", stream=True)
        with pytest.raises(openai.APIError) as error:
            for _ in stream:
                pass
        assert "cut off" in error.value.message
    reply = httpx.post(f"{fake[2]}/v1/completions", json={"prompt": "MIDSTREAM_UNAVAILABLE", "stream": True})
    events = [line for line in reply.text.split("\n\n") if line]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "unavailable"
    assert events[-1] == "data: [DONE]"


def test_the_authorization_header_reaches_the_server_as_grpc_metadata(fake):
    servicer, base = fake[0], fake[2]
    with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-123", max_retries=0) as client:
        assert client.completions.create(model="fake", prompt="hello").choices[0].text == "ok"
    assert servicer.metadata[-1]["authorization"] == "Bearer sk-test-123"
    httpx.post(f"{base}/v1/completions", json={"prompt": "hello"})
    assert "authorization" not in servicer.metadata[-1]


def test_health_follows_the_servers_health(fake):
    health_servicer, base = fake[1], fake[2]
    assert httpx.get(f"{base}/health").status_code == 200
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        reply = httpx.get(f"{base}/health")
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def test_metrics_count_requests_by_endpoint_and_status(fake):
    base = fake[2]
    httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 3})
    text = httpx.get(f"{base}/metrics").text
    assert re.search(r'shardserve_gateway_requests_total\{code="200",endpoint="chat"\} [1-9]', text)
    assert re.search(r'shardserve_gateway_requests_total\{code="400",endpoint="chat"\} [1-9]', text)
    assert "shardserve_gateway_request_duration_seconds_bucket" in text


def test_the_gateway_command_serves_until_sigterm_then_exits_0(fake):
    """`shardserve gateway` on its own, as a second gateway in front of the same server."""
    servicer, upstream = fake[0], fake[3]
    proc = subprocess.Popen([sys.executable, "-m", "shardserve.cli", "gateway", "--upstream", upstream, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        match = re.search(r"shardserve gateway ready: (http://\S+)/v1 -> gRPC (\S+)", line)
        assert match and match.group(2) == upstream, line
        seen = len(servicer.metadata)
        reply = httpx.post(f"{match.group(1)}/v1/completions", json={"prompt": "hello"}, timeout=30)
        assert reply.json()["choices"][0]["text"] == "ok" and len(servicer.metadata) == seen + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
