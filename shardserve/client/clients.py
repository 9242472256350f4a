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
`timeout`, UNAUTHENTICATED without the server's token). Importing this module needs only grpcio and protobuf (no
torch).

A server started with --auth-token-file wants `token=...`; one with TLS wants `tls_root_cert=` (the CA that signed
its certificate; `tls=True` alone trusts the system's roots), and with mutual TLS also `tls_client_cert=` and
`tls_client_key=` (PEM file paths or bytes).

Resuming (the default; `resume=False` turns it off): when an admitted stream breaks with UNAVAILABLE (the server lost
the request: a failed worker group that could not come back, a restarted controller or server, a drain's cut-off), or
with a CANCELLED it did not ask for (the server's side cancelled the call: gRPC does so to calls still open when a
stopping server's grace ends), the stream sends the request again with the tokens it has received (`resume_token_ids`)
and its seed, retrying for up to `resume_timeout_s`, and goes on where it stopped: the caller sees a pause, and the
tokens are those of an unbroken request (the server draws each token from the seed and its index). An unseeded
request's seed is the one the server drew for it at admission and told in the Started message; a server that tells
none leaves such a stream unresumed (unless `resume=True`: it then continues with a new draw). Prompt logprobs are not
asked for again. Not resumed: a request refused before it was admitted (a server starting or draining answers
UNAVAILABLE at once), a stream the caller cancelled, any other status.

Logprobs come as LLM gives them (vLLM's shape): one dict per position, {token id: Logprob(logprob, rank,
decoded_token)}, the chosen token first.
"""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardserve.client.connection import Connection
from shardserve.client.stream import (  # noqa: F401 (the result types are part of this module's API)
    AsyncStream,
    GenerationResult,
    Stream,
    StreamDelta,
    Usage,
)
from shardserve.client.resume import reopener
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc
from shardserve.proto.request_fields import chat_to_proto, structured_outputs_message

# The sampling keywords: GenerateRequest's fields but the request id and the prompt (whose values the server checks).
_REQUEST = pb.GenerateRequest.DESCRIPTOR
_SAMPLING = {fd.name: fd for fd in _REQUEST.fields
             if fd.name not in ("request_id", "resume_token_ids")
             and fd.containing_oneof is not _REQUEST.oneofs_by_name["prompt"]}


def build_request(prompt, request_id: str | None, sampling: dict) -> pb.GenerateRequest:
    """prompt: text, a list of token ids, or chat messages [{"role": ..., "content": ...}]; sampling: GenerateRequest's
    sampling fields by name (None = the server's default). Checks only what building the message needs (the server
    checks the values: INVALID_ARGUMENT): a value the message cannot hold (an integer beyond its field's range, text
    that is not UTF-8 such as a lone surrogate) is a FieldError (a ValueError) naming the field; a value of the
    wrong type, a TypeError naming it."""
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    msg = pb.GenerateRequest()
    if request_id is not None:
        _put("request_id", lambda: setattr(msg, "request_id", request_id))
    if isinstance(prompt, str):
        _put("prompt", lambda: setattr(msg, "text", prompt))
    elif (isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)) or (
            isinstance(prompt, dict) and "messages" in prompt):  # chat, or {"messages": [...], "tools": [...]}
        _put("messages", lambda: chat_to_proto(prompt, msg.chat))
    elif isinstance(prompt, (list, tuple)):
        # an empty list is sent as is: the server answers INVALID_ARGUMENT
        _put("prompt", lambda: msg.token_ids.ids.extend(prompt), "prompt token ids", "integers in [-2**31, 2**31)")
    else:
        raise TypeError(f"a prompt is text, token ids or chat messages; got {type(prompt).__name__}")
    for name, value in sampling.items():
        if value is None:
            continue
        field = _SAMPLING[name]
        if name == "structured_outputs":  # a message of its own (a StructuredOutputsParams or a dict)
            _put(name, lambda: msg.structured_outputs.CopyFrom(structured_outputs_message(value)))
        elif field.message_type is not None:  # a map (logit_bias): token id -> bias
            _put(name, lambda: getattr(msg, name).update(value), f"{name} keys",
                 _holds("integers", field.message_type.fields[0]))
        elif field.is_repeated:  # stop="x" means ["x"]
            _put(name, lambda: getattr(msg, name).extend([value] if isinstance(value, str) else value),
                 holds=_holds("integers", field))
        else:
            _put(name, lambda: setattr(msg, name, value), holds=_holds("an integer", field))
    return msg


# What an integer field of the request can hold, by its protobuf type: said when a value is out of it.
_INT_RANGES = {FieldDescriptor.TYPE_INT32: "[-2**31, 2**31)", FieldDescriptor.TYPE_UINT64: "[0, 2**64)",
               FieldDescriptor.TYPE_INT64: "[-2**63, 2**63)", FieldDescriptor.TYPE_UINT32: "[0, 2**32)"}


def _holds(kind: str, field) -> str | None:
    return f"{kind} in {_INT_RANGES[field.type]}" if field.type in _INT_RANGES else None


class FieldError(ValueError):
    """A value a GenerateRequest cannot hold; .field names the request field (prompt, messages, max_tokens, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _put(field: str, put, what: str | None = None, holds: str | None = None) -> None:
    """Runs put (a change to the message); what protobuf refuses to hold becomes a FieldError naming the field
    (and, for an integer field, the range it holds)."""
    what = what or field
    try:
        put()
    except UnicodeEncodeError as e:
        raise FieldError(field, f"{what} is not valid UTF-8 text ({e.reason} at position {e.start})") from None
    except ValueError as e:  # protobuf: "Value out of range: N" for an integer its field cannot hold
        got = str(e).removeprefix("Value out of range: ")
        if holds is not None and got != str(e):
            raise FieldError(field, f"{what} must be {holds}, got {got[:40]}") from None
        raise FieldError(field, f"{what}: {str(e)[:200]}") from None
    except TypeError as e:  # a value of the wrong type: the caller's bug, as Python says it
        raise TypeError(f"{what}: {e}") from None


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None, *, token: str | None = None,
                 tls: bool = False, tls_root_cert: str | bytes | None = None,
                 tls_client_cert: str | bytes | None = None, tls_client_key: str | bytes | None = None) -> None:
        """timeout: the default deadline in seconds of every call (None = none); each method takes its own.
        token: the server's bearer token; tls*: see the module's docstring."""
        self.address = address
        self.timeout = timeout
        self._channel = Connection(token, tls, tls_root_cert, tls_client_cert, tls_client_key).channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt, *, request_id: str | None = None, timeout: float | None = None, metadata=None,
               resume: bool | None = None, resume_timeout_s: float = 120.0, **sampling) -> Stream:
        """metadata (every call takes it): gRPC call metadata, (key, value) pairs, e.g. (("authorization", "Bearer
        ..."),). resume: send the request again with the tokens received (and the seed) when the stream breaks with
        UNAVAILABLE (default: every request whose rest is then exact; see the module docstring)."""
        request = build_request(prompt, request_id, sampling)
        t = self._t(timeout)
        return Stream(self._stub.Generate(request, timeout=t, metadata=metadata),
                      reopener(self._stub, request, t, metadata, sampling, resume),
                      resume_timeout_s)

    def generate(self, prompt, *, request_id: str | None = None, timeout: float | None = None, metadata=None,
                 **sampling) -> GenerationResult:
        stream = self.stream(prompt, request_id=request_id, timeout=timeout, metadata=metadata, **sampling)
        for _ in stream:
            pass
        return stream.result

    def chat(self, messages: list[dict], *, request_id: str | None = None, timeout: float | None = None,
             metadata=None, **sampling) -> GenerationResult:
        return self.generate(list(messages), request_id=request_id, timeout=timeout, metadata=metadata, **sampling)

    def abort(self, request_id: str, timeout: float | None = None, metadata=None) -> None:
        self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._t(timeout), metadata=metadata)

    def health(self, service: str = "", timeout: float | None = None, metadata=None) -> str:
        """"SERVING" or "NOT_SERVING" (raises grpc.RpcError when the server cannot be reached)."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout),
                                   metadata=metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def model_info(self, timeout: float | None = None, metadata=None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout), metadata=metadata)

    def server_stats(self, timeout: float | None = None, metadata=None) -> pb.ServerStats:
        return self._stub.GetServerStats(pb.ServerStatsRequest(), timeout=self._t(timeout), metadata=metadata)

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

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None, *, token: str | None = None,
                 tls: bool = False, tls_root_cert: str | bytes | None = None,
                 tls_client_cert: str | bytes | None = None, tls_client_key: str | bytes | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = Connection(token, tls, tls_root_cert, tls_client_cert, tls_client_key).aio_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt, *, request_id: str | None = None, timeout: float | None = None, metadata=None,
               resume: bool | None = None, resume_timeout_s: float = 120.0, **sampling) -> AsyncStream:
        """`async for delta in client.stream(...)`; the AsyncStream's .result is set at the end. metadata, resume:
        as Client.stream."""
        request = build_request(prompt, request_id, sampling)
        t = self._t(timeout)
        return AsyncStream(self._stub.Generate(request, timeout=t, metadata=metadata),
                           reopener(self._stub, request, t, metadata, sampling, resume),
                           resume_timeout_s)

    async def generate(self, prompt, *, request_id: str | None = None, timeout: float | None = None, metadata=None,
                       **sampling) -> GenerationResult:
        stream = self.stream(prompt, request_id=request_id, timeout=timeout, metadata=metadata, **sampling)
        async for _ in stream:
            pass
        return stream.result

    async def chat(self, messages: list[dict], *, request_id: str | None = None, timeout: float | None = None,
                   metadata=None, **sampling) -> GenerationResult:
        return await self.generate(list(messages), request_id=request_id, timeout=timeout, metadata=metadata,
                                   **sampling)

    async def abort(self, request_id: str, timeout: float | None = None, metadata=None) -> None:
        await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._t(timeout), metadata=metadata)

    async def health(self, service: str = "", timeout: float | None = None, metadata=None) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout),
                                         metadata=metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def model_info(self, timeout: float | None = None, metadata=None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout), metadata=metadata)

    async def server_stats(self, timeout: float | None = None, metadata=None) -> pb.ServerStats:
        return await self._stub.GetServerStats(pb.ServerStatsRequest(), timeout=self._t(timeout), metadata=metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
