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

Resuming (`resume=True`, the default for greedy requests and for requests with a seed): when a stream breaks with
UNAVAILABLE (the server lost the request: a failed worker group that could not come back, a restarted server, a
drain), the stream sends the request again with the tokens it has received (`resume_token_ids`), retrying for up to
`resume_timeout_s`, and goes on where it stopped: the caller sees a pause, and the tokens are those of an unbroken
request (the server draws each token from the seed and its index). Unseeded sampled requests are not resumed (a new
seed would change the rest), nor is anything else than UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc

# The sampling keywords: GenerateRequest's fields but the request id and the prompt (whose values the server checks).
_REQUEST = pb.GenerateRequest.DESCRIPTOR
_SAMPLING = {fd.name: fd for fd in _REQUEST.fields
             if fd.name not in ("request_id", "resume_token_ids")
             and fd.containing_oneof is not _REQUEST.oneofs_by_name["prompt"]}
RESUME_BACKOFF_S = (0.2, 2.0)  # the first wait between resume tries, and the longest
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    text: str


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    text: str
    top: list[TopLogprob] = field(default_factory=list)  # best first


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamDelta:
    text: str  # may be "" while a multi-byte character is incomplete
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    usage: Usage
    logprobs: list[TokenLogprob] | None
    replica: str  # the engine replica that served it
    stop_reason: str | None = None  # with "stop": the stop string or user stop token id that matched (None: EOS)


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


def _logprobs(delta: pb.GenerateResponse.Delta) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.logprob, lp.text, [TopLogprob(t.token_id, t.logprob, t.text) for t in lp.top_logprobs])
        for lp in delta.logprobs
    ]


class _Collector:
    """Folds a Generate stream's messages into deltas and, at the end, a GenerationResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.prompt_tokens = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.result: GenerationResult | None = None

    def feed(self, msg: pb.GenerateResponse) -> StreamDelta | None:
        kind = msg.WhichOneof("kind")
        if kind == "started":
            self.request_id, self.prompt_tokens = msg.started.request_id, msg.started.prompt_token_count
        elif kind == "delta":
            lps = _logprobs(msg.delta) if msg.delta.logprobs else None
            if lps is not None:
                self.logprobs = (self.logprobs or []) + lps
            self.text.append(msg.delta.text)
            self.token_ids += msg.delta.token_ids
            return StreamDelta(msg.delta.text, list(msg.delta.token_ids), lps)
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
            )
        return None


def _resumable(sampling: dict, resume: bool | None) -> bool:
    """resume=None: greedy (temperature 0) or seeded requests, whose tokens do not depend on where they resume."""
    if resume is not None:
        return resume
    return sampling.get("temperature") == 0 or sampling.get("seed") is not None


class _StreamState:
    """What a blocking and an async stream share: the call and what its messages have told so far. reopen(tokens)
    starts the request again with the tokens received so far (None: no resuming)."""

    def __init__(self, call, reopen=None, resume_timeout_s: float = 120.0) -> None:
        self._call = call
        self._collector = _Collector()
        self._reopen = reopen
        self._resume_timeout_s = resume_timeout_s
        self._resume_until: float | None = None  # while resuming: when to give up
        self._resume_wait_s = RESUME_BACKOFF_S[0]
        self.num_resumes = 0  # how many times the stream was sent again

    def _next_try_s(self, error: grpc.RpcError) -> float | None:
        """After a broken call: seconds to wait before sending the request again, or None to raise the error."""
        import time

        if self._reopen is None or error.code() != grpc.StatusCode.UNAVAILABLE or self._collector.result is not None:
            return None
        now = time.monotonic()
        if self._resume_until is None:
            self._resume_until = now + self._resume_timeout_s
        if now >= self._resume_until:
            return None
        wait_s, self._resume_wait_s = self._resume_wait_s, min(2 * self._resume_wait_s, RESUME_BACKOFF_S[1])
        return min(wait_s, self._resume_until - now)

    def _resumed(self) -> None:
        """A message came on a resumed call: the resume worked, the next break starts a new budget."""
        if self._resume_until is not None:
            self._resume_until, self._resume_wait_s = None, RESUME_BACKOFF_S[0]

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
        import time

        while True:
            try:
                for msg in self._call:
                    self._resumed()
                    delta = self._collector.feed(msg)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as error:
                wait_s = self._next_try_s(error)
                if wait_s is None:
                    raise
                time.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                self.num_resumes += 1
                self._call = self._reopen(list(self._collector.token_ids))

    def wait_started(self) -> str:
        """Reads up to the Started message; returns the request id."""
        while not self._collector.request_id:
            self._collector.feed(next(self._call))
        return self._collector.request_id


class AsyncStream(_StreamState):
    """Async-iterates a request's deltas; the same attributes as Stream. Leaving the loop early (break, an
    exception, a cancelled task) cancels the call, and the server aborts the request."""

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        import asyncio

        try:
            while True:
                try:
                    while (msg := await self._call.read()) is not grpc.aio.EOF:  # read(), as wait_started uses it
                        self._resumed()
                        delta = self._collector.feed(msg)
                        if delta is not None:
                            yield delta
                    return
                except grpc.RpcError as error:
                    wait_s = self._next_try_s(error)
                    if wait_s is None:
                        raise
                    await asyncio.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                    self.num_resumes += 1
                    self._call = self._reopen(list(self._collector.token_ids))
        finally:
            self._call.cancel()  # a no-op once the stream has finished

    async def wait_started(self) -> str:
        while not self._collector.request_id:
            self._collector.feed(await self._call.read())
        return self._collector.request_id


def _reopen_request(request: pb.GenerateRequest, received: list[int]) -> pb.GenerateRequest:
    """The request sent again: a new id (the old one may still be known to the server), the tokens received."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.ClearField("request_id")
    del again.resume_token_ids[:]
    again.resume_token_ids.extend(received)
    return again


def _reopener(stub, request: pb.GenerateRequest, timeout: float | None):
    return lambda received: stub.Generate(_reopen_request(request, received), timeout=timeout)


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

    def stream(self, prompt, *, request_id: str | None = None, timeout: float | None = None,
               resume: bool | None = None, resume_timeout_s: float = 120.0, **sampling) -> Stream:
        """resume: send the request again with the tokens received when the stream breaks with UNAVAILABLE
        (default: for greedy and seeded requests; see the module docstring)."""
        request = build_request(prompt, request_id, sampling)
        return Stream(self._stub.Generate(request, timeout=self._t(timeout)),
                      _reopener(self._stub, request, self._t(timeout)) if _resumable(sampling, resume) else None,
                      resume_timeout_s)

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
               resume: bool | None = None, resume_timeout_s: float = 120.0, **sampling) -> AsyncStream:
        """`async for delta in client.stream(...)`; the AsyncStream's .result is set at the end. resume: as
        Client.stream."""
        request = build_request(prompt, request_id, sampling)
        return AsyncStream(self._stub.Generate(request, timeout=self._t(timeout)),
                           _reopener(self._stub, request, self._t(timeout)) if _resumable(sampling, resume) else None,
                           resume_timeout_s)

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
