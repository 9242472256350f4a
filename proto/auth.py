"""Who may call a shardserve gRPC server: a metadata value checked on every call (the worker plane's per-launch
secret, the client API's bearer token), and TLS credentials from PEM files (the client API's; the worker plane's
optional mutual TLS, WorkerTLS).

Server side, a server interceptor answers UNAUTHENTICATED before the service sees the call unless the call's
metadata carries the expected value (compared with hmac.compare_digest, so its time does not depend on how much of
a guess matched); methods under an open prefix (grpc.health.v1) skip the check. Client side, a channel interceptor
adds the value to every call. Neither ever logs or formats the value.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

WORKER_SECRET_KEY = "x-shardserve-worker-secret"  # gRPC metadata keys are lower case
AUTHORIZATION_KEY = "authorization"  # what an HTTP gateway forwards: "Bearer <token>"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def new_secret() -> str:
    """A per-launch secret for the worker plane (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def read_token_file(path: str) -> str:
    """The token in a file (surrounding whitespace dropped); ValueError naming the file when it is empty."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def _carries(metadata, key: str, expected: bytes) -> bool:
    ok = False
    for k, v in metadata or ():
        if k == key:
            value = v if isinstance(v, bytes) else v.encode()
            ok |= hmac.compare_digest(value, expected)
    return ok


class _Check:
    def __init__(self, key: str, value: str, what: str, open_prefixes: Sequence[str]) -> None:
        self._key = key
        self._expected = value.encode()
        self._open = tuple(open_prefixes)
        self.message = f"this server needs {what} (the call's '{key}' metadata is missing or wrong)"

    def allows(self, details) -> bool:
        return details.method.startswith(self._open) or _carries(details.invocation_metadata, self._key, self._expected)

    def __repr__(self) -> str:  # never the value
        return f"{type(self).__name__}(key={self._key!r})"


class RequireMetadata(grpc.ServerInterceptor, _Check):
    """For grpc.server (threads): calls without the expected metadata value end with UNAUTHENTICATED."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or self.allows(details):
            return handler
        message = self.message

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return _same_kind(handler, deny)


class AsyncRequireMetadata(grpc.aio.ServerInterceptor, _Check):
    """For grpc.aio.server: the same check."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self.allows(details):
            return handler
        message = self.message

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return _same_kind(handler, deny)


def _same_kind(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that runs `behavior` on the undecoded request: an
    unauthenticated caller's bytes are never parsed."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior)
    return grpc.unary_unary_rpc_method_handler(behavior)


# ---- client side ---------------------------------------------------------------------------------------------
class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def _with(details, pair):
    return _Details(details, [*(details.metadata or ()), pair])


class AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """For grpc.intercept_channel: adds (key, value) to every call."""

    def __init__(self, key: str, value: str) -> None:
        self._pair = (key, value)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with(details, self._pair), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with(details, self._pair), request_iterator)

    intercept_stream_stream = intercept_stream_unary

    def __repr__(self) -> str:
        return f"AddMetadata(key={self._pair[0]!r})"


def async_add_metadata(key: str, value: str) -> list:
    """For grpc.aio channels (interceptors=...): adds (key, value) to every call of each kind."""
    pair = (key, value)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(_with(details, pair), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(_with(details, pair), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(_with(details, pair), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(_with(details, pair), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


# ---- TLS -------------------------------------------------------------------------------------------------------
def _read(path_or_pem: str | bytes | None) -> bytes | None:
    if path_or_pem is None or isinstance(path_or_pem, bytes):
        return path_or_pem
    with open(path_or_pem, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a server from PEM files; with client_ca, mutual TLS: a client must present a certificate that CA
    signed, or its handshake fails."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))], root_certificates=_read(client_ca), require_client_auth=client_ca is not None
    )


def channel_credentials(root_cert: str | bytes | None = None, client_cert: str | bytes | None = None,
                        client_key: str | bytes | None = None) -> grpc.ChannelCredentials:
    """TLS for a channel: root_cert (a PEM file or bytes; None = the system's roots) verifies the server;
    client_cert + client_key identify this client to a server that asks (mutual TLS)."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(_read(root_cert), _read(client_key), _read(client_cert))


# ---- the worker plane's TLS (optional) ------------------------------------------------------------------------
WORKER_TLS_NAME = "shardserve-worker"  # the name the controller checks in a worker's certificate


@dataclass(frozen=True)
class WorkerTLS:
    """Mutual TLS between the controller and its workers, from PEM files at the same paths on every node (like the
    model's weights): each Worker server presents cert/key and accepts only callers whose certificate `ca` signed;
    the controller presents the same pair and accepts only servers whose certificate `ca` signed for
    `server_name` (checked by name, not address: workers come and go on addresses Ray hands out). The files are
    read where they are used (the worker on its node, the controller on its own), never sent over Ray."""

    cert: str
    key: str
    ca: str
    server_name: str = WORKER_TLS_NAME

    def check_readable(self) -> None:
        """ValueError naming the first file this node cannot read (serve calls it before starting anything)."""
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA certificate", self.ca)):
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as exc:
                raise ValueError(f"the worker TLS {what} {path} cannot be read: {exc.strerror}") from None

    def server(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert, self.key, client_ca=self.ca)

    def channel(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca, client_cert=self.cert, client_key=self.key)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]
