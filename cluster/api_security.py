"""The client API's edge: who may call it (a bearer token, TLS, mutual TLS), how large a message and a prompt's
text may be, and what a message that does not decode gets (INVALID_ARGUMENT with the reason, never UNKNOWN).

    security = ApiSecurity(token="...", tls_cert="server.pem", tls_key="server.key", client_ca=None)
    server = grpc.aio.server(interceptors=security.interceptors(), options=security.server_options())
    security.bind(server, "127.0.0.1:50051")

The token travels as the `authorization` metadata `Bearer <token>` (what an HTTP gateway forwards) and is compared
in constant time (proto/auth.py); grpc.health.v1 stays open, so load balancers and `Client.wait_ready` need none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from shardserve.proto.auth import AUTHORIZATION_KEY, HEALTH_PREFIX, AsyncRequireMetadata, bearer, server_credentials

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gRPC's own default receive limit, stated: a request above it is refused


@dataclass
class ApiSecurity:
    token: str | None = field(default=None, repr=False)  # None: no token needed
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = field(default=None, repr=False)
    client_ca: str | None = None  # mutual TLS: clients must present a certificate this CA signed
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger messages: RESOURCE_EXHAUSTED
    # prompt text over it: INVALID_ARGUMENT before tokenizing (cluster/prompt_encoder.py); None: 32 B per token
    # of max_model_len, at least 64 KiB
    max_prompt_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.client_ca is not None and self.tls_cert is None:
            raise ValueError("mutual TLS (--tls-client-ca) needs the server's own certificate (--tls-cert, --tls-key)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")

    def interceptors(self) -> list:
        checks = [DecodeErrorsAsInvalidArgument()]
        if self.token is not None:
            checks.insert(0, AsyncRequireMetadata(AUTHORIZATION_KEY, bearer(self.token), "a bearer token",
                                                  (HEALTH_PREFIX,)))
        return checks

    def server_options(self, max_live_requests: int = 4096) -> list[tuple[str, int]]:
        soft, hard = pending_call_limits(max_live_requests)
        return [("grpc.max_receive_message_length", self.max_request_bytes),
                ("grpc.server.max_pending_requests", soft), ("grpc.server.max_pending_requests_hard_limit", hard)]

    def bind(self, server, address: str) -> int:
        """Adds the listening port (TLS when configured); returns the bound port (0 when binding failed)."""
        if self.tls_cert is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, server_credentials(self.tls_cert, self.tls_key, self.client_ca))


def pending_call_limits(max_live_requests: int) -> tuple[int, int]:
    """gRPC core's limits on calls waiting for the application to take them (soft, hard). Past the soft limit
    (1,000 by default) it cancels new calls at random, past the hard one (3,000) all of them: a burst of streams on
    one channel lost some with CANCELLED before they reached the controller. Raised to 8,192 or twice the
    controller's admission limit, whichever is larger (the hard limit twice that), so that the controller decides:
    a burst beyond max_live_requests is refused with RESOURCE_EXHAUSTED, which a client may retry. A waiting call
    holds its headers and what HTTP/2 flow control lets its message send, not a task of ours."""
    soft = max(8192, 2 * max_live_requests)
    return soft, 2 * soft


class DecodeErrorsAsInvalidArgument(grpc.aio.ServerInterceptor):
    """Decodes each request itself: bytes that are not the method's message (or a string field that is not
    UTF-8) end the call with INVALID_ARGUMENT and the parser's reason, where grpc would answer UNKNOWN."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        method = details.method

        async def parse(raw: bytes, context):
            try:
                return decode(raw)
            except Exception as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request to {method} does not decode as its message (not that protobuf "
                                    f"message, or a string field that is not valid UTF-8): {e}")

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(raw, context):
                request = await parse(raw, context)
                async for reply in behavior(request, context):
                    yield reply

            return handler._replace(request_deserializer=None, unary_stream=unary_stream)
        behavior = handler.unary_unary

        async def unary_unary(raw, context):
            return await behavior(await parse(raw, context), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)
