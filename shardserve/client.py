"""The gRPC client of a shardserve server: `Client` (blocking) and `AsyncClient` (asyncio).

    from shardserve.client import Client
    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        for delta in client.stream("Tell me a story", max_tokens=64):
            print(delta.text, end="", flush=True)

Sampling keywords are SamplingParams' fields (temperature, max_tokens, stop, seed, logprobs, ...), which
GenerateRequest's sampling fields mirror; unset ones take the server's defaults. Server errors surface as
grpc.RpcError with their status code (INVALID_ARGUMENT for bad input, UNAVAILABLE while the server is not serving,
RESOURCE_EXHAUSTED beyond its live-request limit, NOT_FOUND for an unknown id on abort, DEADLINE_EXCEEDED past
`timeout`). Importing this module needs only grpcio and protobuf (no torch).
Logprobs come as LLM gives them (vLLM's shape): one dict per position, {token id: Logprob(logprob, rank,
decoded_token)}, the chosen token first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardserve.cluster.outputs import Logprob, PositionLogprobs
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc

# The sampling keywords: GenerateRequest's fields but the request id and the prompt (whose values the server checks).
_REQUEST = pb.GenerateRequest.DESCRIPTOR
_SAMPLING = {fd.name: fd for fd in _REQUEST.fields
             if fd.name != "request_id" and fd.containing_oneof is not _REQUEST.oneofs_by_name["prompt"]}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamDelta:
    text: str  # may be "" while a multi-byte character is incomplete
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None  # one per token id when asked for
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first delta, when asked for


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    usage: Usage
    logprobs: list[PositionLogprobs] | None  # one per generated token when asked for
    replica: str  # the engine replica that served it
    stop_reason: str | None = None  # with "stop": the stop string or user stop token id that matched (None: EOS)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # one per prompt token (None first) when asked for


def build_request(prompt, request_id: str | None, sampling: dict) -> pb.GenerateRequest:
    """prompt: text, a list of token ids, or chat messages [{"role": ..., "content": ...}]; sampling: GenerateRequest's
    sampling fields by name (None = the server's default). Checks only what building the message needs: the
    server checks the values (INVALID_ARGUMENT)."""
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    msg = pb.GenerateRequest()
    if request_id is not None:
        msg.request_id = request_id
    if isinstance(prompt, str):
        msg.text = prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        msg.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    elif isinstance(prompt, (list, tuple)):
        msg.token_ids.ids.extend(prompt)  # an empty list is sent as is: the server answers INVALID_ARGUMENT
    else:
        raise TypeError(f"a prompt is text, token ids or chat messages; got {type(prompt).__name__}")
    for name, value in sampling.items():
        if value is None:
            continue
        if _SAMPLING[name].is_repeated:
            getattr(msg, name).extend([value] if isinstance(value, str) else value)  # stop="x" means ["x"]
        else:
            setattr(msg, name, value)
    return msg


def _logprobs(entries) -> list[PositionLogprobs]:
    """TokenLogprob messages -> vLLM's dicts, as LLM returns them: the token first, then the top N not already in."""
    out = []
    for lp in entries:
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, lp.text)}
        for rank, top in enumerate(lp.top_logprobs, start=1):
            d.setdefault(top.token_id, Logprob(top.logprob, rank, top.text))
        out.append(d)
    return out


class _Collector:
    """Folds a Generate stream's messages into deltas and, at the end, a GenerationResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.prompt_tokens = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.result: GenerationResult | None = None

    def feed(self, msg: pb.GenerateResponse) -> StreamDelta | None:
        kind = msg.WhichOneof("kind")
        if kind == "started":
            self.request_id, self.prompt_tokens = msg.started.request_id, msg.started.prompt_token_count
        elif kind == "delta":
            lps = _logprobs(msg.delta.logprobs) if msg.delta.logprobs else None
            if lps is not None:
                self.logprobs = (self.logprobs or []) + lps
            prompt_lps = None
            if msg.delta.prompt_logprobs:
                prompt_lps = self.prompt_logprobs = [None, *_logprobs(msg.delta.prompt_logprobs)]
            self.text.append(msg.delta.text)
            self.token_ids += msg.delta.token_ids
            return StreamDelta(msg.delta.text, list(msg.delta.token_ids), lps, prompt_lps)
        elif kind == "finished":
            f = msg.finished
            self.result = GenerationResult(
                request_id=self.request_id,
                text="".join(self.text),
                token_ids=self.token_ids,
                finish_reason=_FINISH.get(f.finish_reason),
                usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens),
                logprobs=self.logprobs,
                replica=f.replica,
                stop_reason=f.stop_reason or None,
                prompt_logprobs=self.prompt_logprobs,
            )
        return None


class _StreamState:
    """What a blocking and an async stream share: the call and what its messages have told so far."""

    def __init__(self, call) -> None:
        self._call = call
        self._collector = _Collector()

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    @property
    def result(self) -> GenerationResult | None:
        return self._collector.result

    def cancel(self) -> None:
        """Ends the stream; the server aborts the request and frees its cache blocks."""
        self._call.cancel()


class Stream(_StreamState):
    """Iterates a request's deltas. request_id is known after the first delta (or call .wait_started());
    .result is set once the stream has finished."""

    def __iter__(self) -> Iterator[StreamDelta]:
        for msg in self._call:
            delta = self._collector.feed(msg)
            if delta is not None:
                yield delta

    def wait_started(self) -> str:
        """Reads up to the Started message; returns the request id."""
        while not self._collector.request_id:
            self._collector.feed(next(self._call))
        return self._collector.request_id


class AsyncStream(_StreamState):
    """Async-iterates a request's deltas; the same attributes as Stream. Leaving the loop early (break, an
    exception, a cancelled task) cancels the call, and the server aborts the request."""

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:  # read(), as wait_started uses it
                delta = self._collector.feed(msg)
                if delta is not None:
                    yield delta
        finally:
            self._call.cancel()  # a no-op once the stream has finished

    async def wait_started(self) -> str:
        while not self._collector.request_id:
            self._collector.feed(await self._call.read())
        return self._collector.request_id


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        """timeout: the default deadline in seconds of every call (None = none); each method takes its own."""
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt, *, request_id: str | None = None, timeout: float | None = None, **sampling) -> Stream:
        return Stream(self._stub.Generate(build_request(prompt, request_id, sampling), timeout=self._t(timeout)))

    def generate(self, prompt, *, request_id: str | None = None, timeout: float | None = None,
                 **sampling) -> GenerationResult:
        stream = self.stream(prompt, request_id=request_id, timeout=timeout, **sampling)
        for _ in stream:
            pass
        return stream.result

    def chat(self, messages: list[dict], *, request_id: str | None = None, timeout: float | None = None,
             **sampling) -> GenerationResult:
        return self.generate(list(messages), request_id=request_id, timeout=timeout, **sampling)

    def abort(self, request_id: str, timeout: float | None = None) -> None:
        self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._t(timeout))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """"SERVING" or "NOT_SERVING" (raises grpc.RpcError when the server cannot be reached)."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout))

    def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return self._stub.GetServerStats(pb.ServerStatsRequest(), timeout=self._t(timeout))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Blocks until health is SERVING; raises TimeoutError after `timeout` seconds."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=2.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.address} was not SERVING within {timeout:g} s")
            time.sleep(0.1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The same calls as Client, awaitable; stream() is an async iterator of deltas."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt, *, request_id: str | None = None, timeout: float | None = None,
               **sampling) -> AsyncStream:
        """`async for delta in client.stream(...)`; the AsyncStream's .result is set at the end."""
        return AsyncStream(self._stub.Generate(build_request(prompt, request_id, sampling), timeout=self._t(timeout)))

    async def generate(self, prompt, *, request_id: str | None = None, timeout: float | None = None,
                       **sampling) -> GenerationResult:
        stream = self.stream(prompt, request_id=request_id, timeout=timeout, **sampling)
        async for _ in stream:
            pass
        return stream.result

    async def chat(self, messages: list[dict], *, request_id: str | None = None, timeout: float | None = None,
                   **sampling) -> GenerationResult:
        return await self.generate(list(messages), request_id=request_id, timeout=timeout, **sampling)

    async def abort(self, request_id: str, timeout: float | None = None) -> None:
        await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._t(timeout))

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout))

    async def server_stats(self, timeout: float | None = None) -> pb.ServerStats:
        return await self._stub.GetServerStats(pb.ServerStatsRequest(), timeout=self._t(timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
