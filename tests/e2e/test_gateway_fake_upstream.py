"""The HTTP gateway against a fake gRPC upstream that answers each status code on demand: gRPC statuses become
their HTTP codes with OpenAI error bodies (429, 503, 504, also in mid-stream), the Authorization header reaches the
server as gRPC metadata, health follows the server's, metrics count requests, and `shardserve gateway` serves until
SIGTERM, then exits 0."""

from __future__ import annotations

import gc
import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardserve.gateway.app import GatewayThread
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc


class FakeGeneration(pb_grpc.GenerationServicer):
    """The prompt text names the outcome: a gRPC status code to abort with (before the stream starts), or
    "MIDSTREAM_<CODE>" (after one delta). Anything else: "ok" in one delta."""

    def __init__(self) -> None:
        self.metadata: list[dict] = []
        self.peers: list[str] = []  # each gateway process has its own channel: its own peer address
        self.resumed: list[tuple[list[int], int]] = []  # (resume_token_ids, seed) of each request sent again
        self.requests: list[tuple[str, str, int]] = []  # (text, request_id, seed) of each Generate

    def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.append((request.text, request.request_id, request.seed))
        self.peers.append(context.peer())
        name = request.text
        if name == "CHECK_TOKEN" and self.metadata[-1].get("authorization") != "Bearer sk-good":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
        if name in grpc.StatusCode.__members__:
            context.abort(grpc.StatusCode[name], f"fake {name}")
        if name.startswith("TOO_LARGE"):  # what gRPC answers a message over the server's receive limit
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5000000 vs. 4194304)")
        if name in ("MIDSTREAM_RESUME", "MIDSTREAM_RESUME_CANCELLED"):  # breaks (UNAVAILABLE; CANCELLED) after one
            yield from self._break_then_finish(request, context)  # token; the request sent again finishes
            return
        if name == "SLOW":  # one token, then waits for the client to go
            context.add_callback(lambda: self.resumed.append("SLOW ended"))  # before the client can cancel
            yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id="slow", prompt_token_count=3,
                                                                          seed=42))
            yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text="ok", token_ids=[7]))
            while context.is_active():
                time.sleep(0.01)
            return
        yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id=request.request_id,
                                                                      prompt_token_count=3))
        yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text="ok", token_ids=[7]))
        if name.startswith("MIDSTREAM_"):
            context.abort(grpc.StatusCode[name.removeprefix("MIDSTREAM_")], "cut off")
        yield pb.GenerateResponse(finished=pb.GenerateResponse.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=1)))

    def _break_then_finish(self, request, context):
        if not request.resume_token_ids:
            yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id="first", prompt_token_count=3,
                                                                          seed=42))
            yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text="ok", token_ids=[7]))
            code = grpc.StatusCode.CANCELLED if request.text.endswith("CANCELLED") else grpc.StatusCode.UNAVAILABLE
            context.abort(code, "the server lost the request")
        self.resumed.append((list(request.resume_token_ids), request.seed))
        yield pb.GenerateResponse(started=pb.GenerateResponse.Started(request_id="again", prompt_token_count=3,
                                                                      seed=request.seed))
        yield pb.GenerateResponse(delta=pb.GenerateResponse.Delta(text=" again", token_ids=[8]))
        yield pb.GenerateResponse(finished=pb.GenerateResponse.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=2)))

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
                                         ("UNAVAILABLE", 503), ("CANCELLED", 503), ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 500),
                                         ("UNAUTHENTICATED", 401), ("PERMISSION_DENIED", 403)])
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_statuses_become_their_http_codes_with_openai_error_bodies(fake, code, status, stream):
    reply = httpx.post(f"{fake[2]}/v1/completions", json={"prompt": code, "stream": stream}, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] == f"fake {code}"


@pytest.mark.parametrize("path, body, param", [
    ("completions", b'{"prompt": "hi", "max_tokens": 1000000000000000000000000000000}', "max_tokens"),
    ("completions", b'{"prompt": [1000000000000]}', "prompt"),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate, escaped as JSON allows
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udcff"}]}', "messages"),
    ("completions", b'{"prompt": "hi", "seed": -1}', "seed"),
], ids=["huge-max-tokens", "huge-token-id", "lone-surrogate", "lone-surrogate-chat", "negative-seed"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_value_the_grpc_request_cannot_hold_is_a_400_naming_the_field(fake, path, body, param, stream):
    """Valid JSON the gRPC request cannot carry (an integer beyond its field, text that is not UTF-8): 400 with the
    field, never a 500; the server stays up."""
    body = body[:-1] + (b', "stream": true}' if stream else b"}")
    reply = httpx.post(f"{fake[2]}/v1/{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert httpx.post(f"{fake[2]}/v1/completions", json={"prompt": "hello"}, timeout=30).status_code == 200


def test_a_body_that_is_not_json_is_a_400_saying_so(fake):
    for body in (b'{"prompt": ', b"prompt=hi", b""):
        reply = httpx.post(f"{fake[2]}/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] is None, error
        assert error["message"].startswith("the request body is " + ("empty" if not body else "not valid JSON")), error


def test_an_unknown_path_or_method_is_answered_in_openai_error_bodies(fake):
    """What the routing refuses (404, 405) comes in the envelope OpenAI's clients parse, like every other error."""
    reply = httpx.post(f"{fake[2]}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert reply.status_code == 404
    assert reply.json()["error"] == {"message": "no such endpoint: POST /v1/embeddings", "type": "not_found_error",
                                     "param": None, "code": None}
    reply = httpx.get(f"{fake[2]}/v1/completions", timeout=30)
    assert reply.status_code == 405 and "POST" in reply.headers.get("allow", "")
    assert reply.json()["error"]["message"] == "GET is not allowed on /v1/completions"
    with pytest.raises(openai.NotFoundError, match="no such endpoint"):
        openai.OpenAI(base_url=f"{fake[2]}/v1", api_key="x", max_retries=0).embeddings.create(input="x", model="fake")


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_a_prompt_are_requests_of_their_own_with_seeds_apart(fake, stream):
    """n: prompt-major choices (prompt p's j-th at p * n + j), each its own Generate with seed + j, every prompt's
    tokens counted once in the usage."""
    servicer = fake[0]
    before = len(servicer.requests)
    body = {"prompt": ["one", "two"], "n": 3, "seed": 10, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    reply = httpx.post(f"{fake[2]}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    sent = sorted(servicer.requests[before:], key=lambda r: int(r[1].rsplit("-", 1)[1]))
    assert [(text, seed) for text, _, seed in sent] == [("one", 10), ("one", 11), ("one", 12),
                                                         ("two", 10), ("two", 11), ("two", 12)]
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        assert {c["index"] for e in events for c in e["choices"]} == set(range(6))
        assert sum(c["finish_reason"] is not None for e in events for c in e["choices"]) == 6
        usage = events[-1]["usage"]
    else:
        result = reply.json()
        assert [c["index"] for c in result["choices"]] == list(range(6))
        assert [c["text"] for c in result["choices"]] == ["ok"] * 6
        usage = result["usage"]
    assert usage == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,  # 3 a prompt, once each
                     "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_outside_1_to_16_is_a_400_naming_it(fake, n):
    reply = httpx.post(f"{fake[2]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "n": n}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n", reply.text


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


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_stream_broken_with_unavailable_resumes_with_its_tokens_and_seed(fake, stream):
    """The gateway's upstream stream resumes as the Python client's does: sent again with the tokens it had and the
    seed the server told; the HTTP client sees one whole completion."""
    with openai.OpenAI(base_url=f"{fake[2]}/v1", api_key="x", max_retries=0) as client:
        if stream:
            chunks = list(client.completions.create(model="fake", prompt="MIDSTREAM_RESUME", stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            text = client.completions.create(model="fake", prompt="MIDSTREAM_RESUME").choices[0].text
    assert text == "ok again"
    assert fake[0].resumed[-1] == ([7], 42)


def test_a_stream_the_server_cancelled_resumes_one_the_caller_cancelled_does_not(fake):
    """CANCELLED from the server's side (gRPC cancels calls still open when a stopping server's grace ends) is a
    break like UNAVAILABLE: the client sends the request again with its tokens and seed. The caller's own cancel()
    ends the stream for good."""
    from shardserve.client.clients import Client

    with Client(fake[3], timeout=30) as client:
        result = client.generate("MIDSTREAM_RESUME_CANCELLED", max_tokens=2)
        assert result.text == "ok again" and result.finish_reason == "length"
        assert fake[0].resumed[-1] == ([7], 42)
        resumed_before = len(fake[0].resumed)
        stream = client.stream("SLOW", max_tokens=2)
        received = []
        with pytest.raises(grpc.RpcError) as ended:
            for delta in stream:
                received.append(delta.token_ids)
                stream.cancel()
        assert ended.value.code() == grpc.StatusCode.CANCELLED and received == [[7]]
        assert stream.num_resumes == 0
    deadline = time.monotonic() + 10
    while fake[0].resumed[resumed_before:] != ["SLOW ended"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake[0].resumed[resumed_before:] == ["SLOW ended"]  # the call ended (the cancel), and was not sent again


def test_the_authorization_header_reaches_the_server_as_grpc_metadata(fake):
    servicer, base = fake[0], fake[2]
    with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-123", max_retries=0) as client:
        assert client.completions.create(model="fake", prompt="hello").choices[0].text == "ok"
    assert servicer.metadata[-1]["authorization"] == "Bearer sk-test-123"
    httpx.post(f"{base}/v1/completions", json={"prompt": "hello"})
    assert "authorization" not in servicer.metadata[-1]


def test_a_token_the_server_refuses_is_an_http_401_and_a_good_one_passes(fake):
    """The server checks the forwarded `authorization` metadata (here the fake): UNAUTHENTICATED becomes 401, which
    the openai package raises as AuthenticationError."""
    base = fake[2]
    with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-bad", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError, match="a valid bearer token is required"):
            client.completions.create(model="fake", prompt="CHECK_TOKEN")
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="fake", prompt="CHECK_TOKEN", stream=True)
    with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-good", max_retries=0) as client:
        assert client.completions.create(model="fake", prompt="CHECK_TOKEN").choices[0].text == "ok"
    reply = httpx.post(f"{base}/v1/completions", json={"prompt": "CHECK_TOKEN"})  # no header at all
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


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
    httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 30})
    text = httpx.get(f"{base}/metrics").text
    assert re.search(r'shardserve:gateway_requests_total\{code="200",endpoint="chat"\} [1-9]', text)
    assert re.search(r'shardserve:gateway_requests_total\{code="400",endpoint="chat"\} [1-9]', text)
    assert "shardserve:gateway_request_duration_seconds_bucket" in text


def test_the_gateway_command_serves_until_sigterm_then_exits_0(fake):
    """`shardserve gateway` on its own, as a second gateway in front of the same server."""
    servicer, upstream = fake[0], fake[3]
    proc = subprocess.Popen([sys.executable, "-m", "shardserve.cli.main", "gateway", "--upstream", upstream, "--port", "0"],
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


def _start_gateway(upstream: str, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "shardserve.cli.main", "gateway", "--upstream", upstream, "--port", "0",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # printed once every worker listens
    match = re.search(r"shardserve gateway ready: (http://\S+)/v1 -> gRPC (\S+)", line)
    if not match:
        proc.kill()
        raise AssertionError(f"no ready line: {line!r} {proc.stderr.read()}")
    return proc, match.group(1)


def test_gateway_workers_share_the_port_and_stop_with_it(fake):
    """--workers 3: three processes (this one and two it starts) accept on one port, each with its own gRPC
    channel; SIGTERM to the first stops all three, exit code 0."""
    servicer, upstream = fake[0], fake[3]
    proc, base = _start_gateway(upstream, "--workers", "3")
    try:
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        seen = len(servicer.peers)
        for _ in range(30):  # a new connection each: the kernel spreads them over the three sockets
            assert httpx.post(f"{base}/v1/completions", json={"prompt": "hello"}).json()["choices"][0]["text"] == "ok"
        assert len(set(servicer.peers[seen:])) >= 2  # 30 connections all on one socket: 3 * (1/3)**30
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive  # (their exit codes went to their parent, which waited for them)


def test_gateway_workers_exit_when_their_parent_is_killed(fake):
    proc, base = _start_gateway(fake[3], "--workers", "2")
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == 1 and workers[0].is_running()
    proc.kill()  # no chance to stop them: they see their stdin close
    proc.wait(30)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    for p in alive:
        p.kill()
    assert not alive


def test_health_is_503_not_500_when_the_upstream_cannot_say():
    """An upstream whose health check fails (here: it has no health service, UNIMPLEMENTED; in a shutting-down
    server, a call cut off) makes /health answer 503 with the reason: a balancer's probe never sees a 500."""
    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gateway = GatewayThread(f"127.0.0.1:{port}", "127.0.0.1", 0)
    try:
        reply = httpx.get(f"http://{gateway.address}/health", timeout=30)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "unavailable" and "UNIMPLEMENTED" in reply.json()["error"]["message"]
    finally:
        gateway.stop()
        server.stop(None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_over_the_servers_grpc_limit_is_413_not_a_429_to_retry(fake, stream):
    """RESOURCE_EXHAUSTED is the server's load (429, retried by clients) unless gRPC says the message was too large:
    the same request can never pass, so 413."""
    reply = httpx.post(f"{fake[2]}/v1/completions", json={"prompt": "TOO_LARGE", "stream": stream}, timeout=30)
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "request_too_large" and "larger than max" in reply.json()["error"]["message"]
    assert httpx.post(f"{fake[2]}/v1/completions", json={"prompt": "RESOURCE_EXHAUSTED"}).status_code == 429


def test_a_refused_request_leaves_no_reference_cycle_holding_its_prompt(fake):
    """A stream the server refuses used to leave a cycle (the error, its traceback, a frame holding the error) that
    kept the request's prompt and message alive until the cyclic collector ran, which large bodies outpace: the
    gateway grew by ~3x each refused body. With the collector off, nothing of such a request is left for it."""
    gc.collect()
    gc.disable()
    try:
        for prompt in ("TOO_LARGE " + "x" * 100_000, "INVALID_ARGUMENT"):
            for stream in (False, True):
                reply = httpx.post(f"{fake[2]}/v1/completions", json={"prompt": prompt, "stream": stream}, timeout=30)
                assert reply.status_code in (400, 413)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (pb.GenerateRequest, grpc.RpcError))]
        assert not left, left[:3]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("path, body, param, says", [
    ("completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens", "valid integer"),
    ("completions", {"prompt": "hi", "max_tokens": 8.0}, "max_tokens", "valid integer"),
    ("completions", {"prompt": "hi", "stream": "true"}, "stream", "valid boolean"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed", "seed must be an integer in [0, 2**64), got -1"),
    ("completions", {"prompt": [2**40]}, "prompt", "prompt token ids must be integers in [-2**31, 2**31)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 100},
     "top_logprobs", "top_logprobs must be an integer in [0, 20], got 100"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens must be an integer >= 1, got -1"),
], ids=["string-int", "float-int", "string-bool", "seed-range", "token-id-range", "top-logprobs", "max-completion"])
def test_a_400_names_the_field_the_request_used_and_its_range(fake, path, body, param, says):
    reply = httpx.post(f"{fake[2]}/v1/{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error
