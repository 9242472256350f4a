"""The OpenAI-compatible HTTP gateway: a thin, stateless FastAPI layer over the gRPC client API.

    shardserve gateway --upstream 127.0.0.1:50051 --port 8000      # or: shardserve serve ... --http-port 8000

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streamed over SSE with "stream": true),
GET /v1/models, GET /health (200 while the server is SERVING, else 503), GET /metrics (the gateway's own).
Each request becomes one gRPC Generate stream per prompt on the one channel this process keeps (one AsyncClient);
the chat template is applied by the server, as for the gRPC API's chat messages. Nothing is kept between requests,
so any number of gateways may front one server. An `Authorization` header is forwarded as the gRPC metadata
`authorization`, which the server checks where it was given a token (`serve --api-key`, `--auth-token-file`): every
path but /health answers a caller the server refuses with 401, /v1/models and /metrics included (what the gateway
caches of the server is kept per Authorization header). A client that disconnects cancels its gRPC streams, and
the server frees the request's KV blocks.

Status mapping (OpenAI error bodies {"error": {"message", "type", "param", "code"}}): invalid input (ours, or the
server's INVALID_ARGUMENT with its reason) 400, an unknown model 404, RESOURCE_EXHAUSTED 429 (413 where it is
gRPC's message limit: the same request can never pass), UNAVAILABLE 503, DEADLINE_EXCEEDED 504. An error after a
stream has begun arrives as a last `data: {"error": ...}` event. What a request and a connection may cost the
gateway (body size, prompts, header size, read timeouts, open connections) is GatewayLimits'
(shardserve/gateway/request_limits.py): past it 413, 400, 431, 408 or 503, before the body is read whole.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve.client.clients import AsyncClient
from shardserve.gateway.connections import protocol_class
from shardserve.gateway.generation import Gateway, metadata_of
from shardserve.gateway.http_errors import GatewayError
from shardserve.gateway.processes import Workers, bind, exit_with_stdin
from shardserve.gateway.openai_format import error_body
from shardserve.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from shardserve.gateway.request_limits import BodyLimits, GatewayLimits


def build_app(upstream: str, request_timeout_s: float | None = None, upstream_tls: dict | None = None,
              limits: GatewayLimits | None = None) -> FastAPI:
    """The ASGI app for a gateway in front of the gRPC server at `upstream` (host:port); upstream_tls: AsyncClient's
    tls keywords (the token is not one: each HTTP request's Authorization header is forwarded)."""
    limits = limits or GatewayLimits()
    gateway = Gateway(upstream, request_timeout_s, max_prompts=limits.max_prompts)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.client = AsyncClient(upstream, **(upstream_tls or {}))  # the one channel of this gateway, made on its event loop
        try:
            yield
        finally:
            await gateway.client.close()

    app = FastAPI(title="shardserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.add_middleware(BodyLimits, limits=limits, on_refused=gateway.metrics.refused_for)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _param(error.get("loc", ()))
        if error.get("type") == "json_invalid":  # loc is ("body", offset): the offset is no param
            offset = next((p for p in error.get("loc", ()) if isinstance(p, int)), None)
            param, message = None, ("the request body is not valid JSON"
                                    + (f" (at character {offset})" if offset is not None else ""))
        elif error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",):
            message = "the request body is empty: a JSON object is expected"
        elif error.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif param and param.split(".")[0] == "prompt":  # one error per alternative of the union: say them all
            param, message = "prompt", ("prompt must be a string, a list of strings, a list of token ids or a list "
                                        "of lists of token ids")
        else:
            message = f"{param or 'body'}: {error.get('msg')}"
        endpoint = "chat" if request.url.path.endswith("chat/completions") else "completions"
        gateway.metrics.requests.labels(endpoint, "400").inc()
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own errors (an unknown path 404, a wrong method 405) in OpenAI's error body, as every other."""
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gateway.generate(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gateway.generate(request, body, chat=True)

    def model_card(info) -> dict:
        return {"id": info.model, "object": "model", "created": 0, "owned_by": "shardserve", "root": info.model,
                "max_model_len": info.max_model_len, "vocab_size": info.vocab_size, "architecture": info.architecture,
                "tensor_parallel_size": info.tensor_parallel_size, "has_tokenizer": bool(info.tokenizer),
                "has_chat_template": info.has_chat_template}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            info = await gateway.model_info(metadata_of(request))
        except GatewayError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [model_card(info)]})

    @app.get("/v1/models/{model_id:path}")  # (a name may hold slashes: "Qwen/Qwen3-0.6B")
    async def model(model_id: str, request: Request) -> Response:
        try:
            info = await gateway.model_info(metadata_of(request))
        except GatewayError as e:
            return e.response()
        if model_id != info.model:
            return GatewayError(404, f"The model '{model_id}' does not exist (this server serves '{info.model}')",
                                "invalid_request_error", "model", "model_not_found").response()
        return JSONResponse(model_card(info))

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the server is SERVING; 401/403 for a caller the server refuses; else 503, whatever kept the
        answer from coming (a health check is how a balancer learns to stop sending: never a 500)."""
        try:
            status = await gateway.client.health(timeout=5, metadata=metadata_of(request))
        except (grpc.RpcError, grpc.aio.UsageError) as e:  # (UsageError: the gateway's channel closed, stopping)
            if isinstance(e, grpc.RpcError):
                if (error := GatewayError.of_rpc(e)).status < 500:
                    return error.response()
                reason = f"{e.code().name}: {e.details()}"
            else:
                reason = f"the gateway's channel is closed ({e})"
            return GatewayError(503, f"the server's health is unknown: {reason}", "service_unavailable_error", None,
                                "unavailable").response()
        if status != "SERVING":
            return GatewayError(503, f"the server is {status}", "service_unavailable_error", None,
                                "unavailable").response()
        return JSONResponse({"status": "ok", "upstream": upstream})

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's liveness path (SageMaker's): as /health

    @app.get("/version")
    async def version(request: Request) -> Response:
        try:  # as every path but health: the server's token where it asks for one
            await gateway.model_info(metadata_of(request))
        except GatewayError as e:
            return e.response()
        from shardserve import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:  # the server's rule for every path but health: its token where it asks for one
            await gateway.model_info(metadata_of(request))
        except GatewayError as e:
            return e.response()
        return Response(gateway.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---- running it ---------------------------------------------------------------------------------------------
def _local(upstream: str) -> str:
    """A server bound to every interface is reached on loopback."""
    host, _, port = upstream.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "::") else upstream


def _server(upstream: str, sock: socket.socket, request_timeout_s: float | None, access_log: bool,
            on_signal=None, upstream_tls: dict | None = None, limits: GatewayLimits | None = None):
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM / SIGINT: to the other workers too
            if on_signal is not None:
                on_signal(sig)
            super().handle_exit(sig, frame)

    limits = limits or GatewayLimits()
    app = build_app(_local(upstream), request_timeout_s, upstream_tls, limits)
    metrics = app.state.gateway.metrics
    config = uvicorn.Config(app, log_level="warning", access_log=access_log, timeout_graceful_shutdown=5,
                            lifespan="on", timeout_keep_alive=limits.keep_alive_s,
                            http=protocol_class(limits, metrics.refused_for, metrics.connection))
    return Server(config)


def run_gateway(upstream: str, host: str = "127.0.0.1", port: int = 8000, request_timeout_s: float | None = None,
                access_log: bool = False, workers: int = 1, worker_of_parent: bool = False,
                upstream_tls: dict | None = None, limits: GatewayLimits | None = None) -> int:
    """`shardserve gateway`: serves until SIGINT/SIGTERM (uvicorn's graceful shutdown). workers > 1: this process
    and workers - 1 more on the same port (shardserve/gateway/processes.py)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    sock = bind(host, port, reuse_port=workers > 1 or worker_of_parent)
    bound = sock.getsockname()[1]
    others = None
    if workers > 1 and not worker_of_parent:
        try:
            others = Workers(workers, upstream, host, bound, request_timeout_s, access_log, upstream_tls,
                             limits=limits)
        except BaseException:
            sock.close()
            raise
    count = f" ({workers} workers)" if workers > 1 else ""
    print(f"shardserve gateway ready: http://{host}:{bound}/v1 -> gRPC {upstream}{count}", flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the handlers it found:
    # no-op ones make that a normal exit (0), as `shardserve serve` exits after its drain.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = _server(upstream, sock, request_timeout_s, access_log, others and others.signal, upstream_tls,
                         limits)
        if worker_of_parent:
            exit_with_stdin(server)
        server.run(sockets=[sock])
    finally:
        if others is not None:
            others.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


class GatewayThread:
    """A gateway on a thread of its own (its own event loop): how `shardserve serve --http-port` runs it. workers > 1:
    and workers - 1 gateway processes on the same port (`--http-workers`), stopped with it."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0,
                 request_timeout_s: float | None = None, ready_timeout_s: float = 30.0, workers: int = 1,
                 limits: GatewayLimits | None = None) -> None:
        if workers < 1:
            raise ValueError(f"--http-workers must be >= 1, got {workers}")
        sock = bind(host, port, reuse_port=workers > 1)
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._workers = None
        if workers > 1:
            try:
                self._workers = Workers(workers, _local(upstream), host, sock.getsockname()[1], request_timeout_s,
                                        access_log=False, ready_timeout_s=ready_timeout_s, limits=limits)
            except BaseException:
                sock.close()
                raise
        self._server = _server(upstream, sock, request_timeout_s, access_log=False, limits=limits)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="shardserve-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._server.started:  # uvicorn has no ready event; startup takes milliseconds
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP gateway on {self.address} did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops accepting, lets open responses end (up to uvicorn's 5 s grace), closes the gRPC channel."""
        if self._workers is not None:
            self._workers.signal(signal.SIGTERM)  # they drain while this thread's server does
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._workers is not None:
            self._workers.stop(timeout_s)


def _param(loc) -> str | None:
    """A validation error's location as OpenAI names a param ("messages.0.content"): without "body" and without
    the type tags pydantic adds for each alternative of a union ("str", "list[int]", "TextPart")."""
    parts = [str(p) for p in loc if p != "body"]
    kept = [p for p in parts if not ("[" in p or p[:1].isupper() or p in ("str", "int", "float", "bool"))]
    return ".".join(kept) or None
