"""How the gateway answers a generation request (shardserve/gateway/app.py has the routes): the upstream gRPC client,
the OpenAI request -> Generate streams (admission errors become HTTP errors before any stream begins), the streams
-> one JSON body or server-sent events (gRPC statuses become HTTP errors in shardserve/gateway/http_errors.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shardserve.client.clients import AsyncClient, FieldError
from shardserve.cluster.sampling_params import output_seed
from shardserve.gateway.http_errors import GatewayError
from shardserve.gateway.http_metrics import GatewayMetrics
from shardserve.gateway.openai_format import DONE, Choice, prompt_tokens, response_body, usage_chunk
from shardserve.gateway.tool_calls import ToolCallChoice
from shardserve.proto import generation_pb2 as pb

MODEL_INFO_TTL_S = 30.0
MODEL_INFO_CALLERS = 64  # cached model infos, one per Authorization header the server accepted (oldest dropped)


class Gateway:
    """The app's state: one upstream client (AsyncClient: one channel), the cached model info, the metrics."""

    def __init__(self, upstream: str, request_timeout_s: float | None = None, max_prompts: int = 256) -> None:
        self.upstream_address = upstream
        self.request_timeout_s = request_timeout_s
        self.max_prompts = max_prompts  # in one completions request (GatewayLimits.max_prompts)
        self.metrics = GatewayMetrics()
        self.client: AsyncClient | None = None
        self._info: dict[str | None, tuple[pb.ModelInfo, float]] = {}  # Authorization header -> (info, when)

    async def model_info(self, metadata) -> pb.ModelInfo:
        """The server's model info as the caller may see it: cached per Authorization header, so that an answer the
        server gave one caller's token is never handed to a caller without it (a wrong or missing token goes to
        the server, which refuses it: 401). Also how the gateway's own endpoints check a caller."""
        key = dict(metadata or ()).get("authorization")
        cached = self._info.get(key)
        if cached is None or time.monotonic() - cached[1] > MODEL_INFO_TTL_S:
            try:
                info = await self.client.model_info(timeout=10, metadata=metadata)
            except grpc.RpcError as e:
                self._info.pop(key, None)
                raise GatewayError.of_rpc(e) from None
            if key not in self._info and len(self._info) >= MODEL_INFO_CALLERS:
                self._info.pop(next(iter(self._info)))
            cached = self._info[key] = (info, time.monotonic())
        return cached[0]

    # ---- one request ----------------------------------------------------------------------------------------
    async def generate(self, request: Request, body, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        arrival = time.perf_counter()
        self.metrics.in_flight.inc()
        streaming = False
        try:
            if (unsupported := body.unsupported()) is not None:
                raise GatewayError(400, str(unsupported), "invalid_request_error", unsupported.param)
            if not chat and len(body.prompts()) > self.max_prompts:
                raise GatewayError(400, f"prompt must be at most {self.max_prompts} prompts a request "
                                   f"(--max-prompts), got {len(body.prompts())}", "invalid_request_error", "prompt")
            metadata = metadata_of(request)
            info = await self.model_info(metadata)
            if body.model is not None and body.model != info.model:
                raise GatewayError(404, f"The model '{body.model}' does not exist (this server serves "
                                   f"'{info.model}')", "invalid_request_error", "model", "model_not_found")
            prompts = [body.chat()] if chat else body.prompts()
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            sampling = body.sampling()
            if not body.stream:
                sampling["final_only"] = True  # upstream: one message per choice when it ends, not one per token
            n = body.n or 1
            choices, work = [], []  # prompt-major, as OpenAI orders them: prompt p's j-th choice is p * n + j
            for prompt in prompts:
                for j in range(n):
                    options = dict(top_logprobs=sampling.get("logprobs"), usage_field=body.include_usage,
                                   token_ids=body.return_token_ids, echo=sampling.get("echo", False),
                                   echo_only=body.echo_only, prompt_logprobs=body.prompt_logprobs is not None,
                                   stop_token_ids=body.stop_token_ids or ())
                    mode = body.tool_mode() if chat else None
                    choice = (Choice(chat, rid, info.model, len(choices), **options) if mode is None else
                              ToolCallChoice(chat, rid, info.model, len(choices), tool_mode=mode, **options))
                    choice.prompt_shared = j > 0
                    seeded = dict(sampling)  # a seeded request's choices differ: the j-th draws with seed + j
                    if "seed" in sampling:
                        seeded["seed"] = output_seed(sampling["seed"], j)
                    choices.append(choice)
                    work.append((prompt, seeded))
            calls = []
            try:
                for i, (prompt, seeded) in enumerate(work):
                    calls.append(await self._start(prompt, seeded, rid if len(work) == 1 else f"{rid}-{i}",
                                                   metadata, choices[i], "messages" if chat else "prompt"))
            except BaseException:
                for call in calls:
                    call.cancel()
                raise
            if body.stream:
                streaming = True
                return _EventStream(self._events(calls, choices, body.include_usage, chat, rid, info.model,
                                                 endpoint, arrival), rid, calls, self.metrics)
            return await self._collect(request, calls, choices, chat, rid, info.model, endpoint, arrival)
        except GatewayError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return e.response()
        finally:
            if not streaming:
                self.metrics.in_flight.dec()

    async def _start(self, prompt, sampling: dict, rid: str, metadata, choice: Choice,
                     prompt_field: str = "prompt") -> "_Call":
        """Opens the Generate stream and reads its Started message, so that admission errors become HTTP errors.
        (A request without max_tokens gets the rest of the context from the server.)"""
        try:
            stream = self.client.stream(prompt, request_id=rid, timeout=self.request_timeout_s, metadata=metadata,
                                        **sampling)
        except FieldError as e:  # a value the gRPC request cannot hold (client.build_request)
            raise GatewayError(400, str(e), "invalid_request_error", e.field, "invalid_argument") from None
        call = _Call(stream)
        try:
            first = await anext(call.messages, None)
        except grpc.RpcError as e:
            call.cancel()
            self.metrics.upstream_errors.labels(e.code().name).inc()
            raise GatewayError.of_rpc(e, prompt_field) from None
        except BaseException:
            call.cancel()
            raise
        if first is None or first.WhichOneof("kind") != "started":
            call.cancel()
            raise GatewayError(502, "the server's stream did not start with Started", "server_error")
        choice.started_msg(first.started)
        return call

    async def _collect(self, request: Request, calls, choices, chat, rid, model, endpoint, arrival) -> Response:
        async def read(call, choice: Choice) -> str:
            replica = ""
            async for msg in call.messages:
                kind = msg.WhichOneof("kind")
                if kind == "delta":
                    choice.add(msg.delta)
                elif kind == "finished":
                    choice.finished_msg(msg.finished)
                    replica = msg.finished.replica
            return replica

        work = asyncio.ensure_future(asyncio.gather(*(read(c, ch) for c, ch in zip(calls, choices)),
                                                    return_exceptions=True))
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: abort upstream
                self.metrics.disconnects.inc()
                self.metrics.requests.labels(endpoint, "499").inc()
                return Response(status_code=499)
            replicas = work.result()
            for outcome in replicas:
                if isinstance(outcome, grpc.RpcError):
                    self.metrics.upstream_errors.labels(outcome.code().name).inc()
                    raise GatewayError.of_rpc(outcome) from None
                if isinstance(outcome, BaseException):
                    raise outcome
        finally:
            left.cancel()
            work.cancel()
            for call in calls:
                call.cancel()
        self._count(endpoint, "200", choices, arrival)
        return JSONResponse(response_body(chat, rid, model, choices, replicas[0]), headers={"X-Request-Id": rid})

    async def _events(self, calls, choices: list[Choice], include_usage, chat, rid, model, endpoint, arrival):
        """The SSE body. Cancelled (the client left): the finally cancels the gRPC streams."""
        code, first = "200", True
        try:
            for choice in choices:
                if (chunk := choice.first_chunk()) is not None:
                    yield chunk
            async for chunk in (_one(calls[0], choices[0]) if len(calls) == 1 else _merged(calls, choices)):
                if first:
                    first = False
                    self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - arrival)
                yield chunk
            if include_usage:
                yield usage_chunk(chat, rid, model, choices)
            yield DONE
        except grpc.RpcError as e:  # the status code is sent already: the error goes in the stream
            self.metrics.upstream_errors.labels(e.code().name).inc()
            error = GatewayError.of_rpc(e)
            code = str(error.status)
            yield error.event()
            yield DONE
        except BaseException:
            code = "499"
            self.metrics.disconnects.inc()
            raise
        finally:
            for call in calls:
                call.cancel()
            if code == "200":
                self._count(endpoint, code, choices, arrival)
            else:
                self.metrics.requests.labels(endpoint, code).inc()

    def _count(self, endpoint: str, code: str, choices: list[Choice], arrival: float) -> None:
        self.metrics.requests.labels(endpoint, code).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - arrival)
        self.metrics.prompt_tokens.inc(prompt_tokens(choices))
        self.metrics.completion_tokens.inc(sum(c.completion_tokens for c in choices))


class _EventStream(StreamingResponse):
    """The SSE response. Its end, however it comes (even a client gone before the body began, when the body's
    generator never runs), cancels the gRPC streams: the server then frees the requests."""

    def __init__(self, events, request_id: str, calls, metrics: GatewayMetrics) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"X-Request-Id": request_id})
        self.calls, self.metrics = calls, metrics

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for call in self.calls:
                call.cancel()
            self.metrics.in_flight.dec()


class _Call:
    """One Generate stream: its raw messages (the AsyncStream's) and cancel()."""

    __slots__ = ("stream", "messages")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.messages = stream.messages()

    def cancel(self) -> None:
        self.stream.cancel()


async def _one(call: _Call, choice: Choice):
    async for msg in call.messages:
        kind = msg.WhichOneof("kind")
        if kind == "delta":
            if (chunk := choice.delta_chunk(msg.delta)) is not None:
                yield chunk
        elif kind == "finished":
            choice.finished_msg(msg.finished)
            yield choice.last_chunk()


async def _merged(calls, choices):
    """Several prompts' streams, interleaved as their chunks arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(call, choice):
        try:
            async for chunk in _one(call, choice):
                queue.put_nowait(chunk)
            queue.put_nowait(None)
        except BaseException as e:
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(c, ch)) for c, ch in zip(calls, choices)]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def metadata_of(request: Request):
    """The caller's `Authorization: Bearer ...` header, forwarded as the gRPC metadata `authorization`."""
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else None
