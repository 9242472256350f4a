"""What one HTTP request and one connection may cost the gateway, and the refusals past it.

GatewayLimits holds the settings (flags of `shardserve gateway`, and of `serve` for its own gateway). Where they
are enforced:
- here, BodyLimits (ASGI middleware, before any route): a JSON body only (415 otherwise), its Content-Length
  checked before a byte of it is read (413), a chunked body counted as it comes and cut off at the limit (413);
  a refusal closes the connection, so that a client still sending learns at once and the gateway reads no more;
- the gateway's protocol (shardserve/gateway/connections.py): header size, header and body timeouts, the
  connection cap;
- uvicorn: the keep-alive idle timeout (timeout_keep_alive);
- the route (generation.py): prompts a request (400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from shardserve.cluster.api_security import DEFAULT_MAX_REQUEST_BYTES
from shardserve.gateway.openai_format import error_body


def _limit(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class GatewayLimits:
    """Each field is a flag of `shardserve gateway` (--max-request-bytes, --max-prompts, ...), with its help."""

    max_request_bytes: int = _limit(
        DEFAULT_MAX_REQUEST_BYTES, "a request body larger than this is refused with 413 before it is read whole; 4 "
        "MiB is the gRPC server's default message limit (`serve --http-port` takes the server's --max-request-bytes)")
    max_prompts: int = _limit(256, "prompts in one /v1/completions request at most (400 beyond)")
    max_header_bytes: int = _limit(32 * 1024, "request line and headers at most, in bytes (431 beyond)")
    header_timeout_s: float = _limit(10.0, "seconds a new connection or request has to send its request line and "
                                           "headers (then 408 and closed)")
    body_timeout_s: float = _limit(60.0, "seconds a request has to send its whole body once its headers are in "
                                         "(then 408 and closed)")
    keep_alive_s: float = _limit(5.0, "seconds an idle keep-alive connection stays open between requests")
    max_connections: int = _limit(1024, "open HTTP connections per gateway process at most: a request on one past "
                                        "it is answered 503 and its connection closed")

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{flag_of(f.name)} must be > 0, got {getattr(self, f.name)}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")

    def flags(self) -> list[str]:
        """The command line that gives another gateway process these limits (`--workers`)."""
        return [arg for f in fields(self) for arg in (flag_of(f.name), str(getattr(self, f.name)))]


def flag_of(name: str, prefix: str = "") -> str:
    """max_request_bytes -> --max-request-bytes, header_timeout_s -> --header-timeout (prefix "http-": --http-...)."""
    return "--" + prefix + name.removesuffix("_s").replace("_", "-")


def add_limit_flags(parser, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """GatewayLimits' fields as flags of `parser` (an argparse parser or group), but those in skip; prefix "http-"
    for serve's own gateway (--http-max-prompts)."""
    for f in fields(GatewayLimits):
        if f.name not in skip:
            parser.add_argument(flag_of(f.name, prefix), dest=prefix.replace("-", "_") + f.name,
                                type=type(f.default), default=f.default, metavar="S" if f.name.endswith("_s") else "N",
                                help=f.metadata["help"])


def limits_from_args(args, prefix: str = "", **given) -> GatewayLimits:
    """GatewayLimits from add_limit_flags' flags (and `given` for those skipped); ValueError naming a bad flag."""
    attr = prefix.replace("-", "_")
    values = {f.name: getattr(args, attr + f.name) for f in fields(GatewayLimits) if hasattr(args, attr + f.name)}
    return GatewayLimits(**{**values, **given})


_JSON = ("application/json", "application/x-ndjson")  # (OpenAI's SDKs send application/json)
_CLOSE = (b"connection", b"close")


class BodyLimits:
    """ASGI middleware: a request body is JSON and at most max_request_bytes; the app then gets the body as one
    message (read once, here). `on_refused(reason)` counts each refusal."""

    def __init__(self, app, limits: GatewayLimits, on_refused) -> None:
        self.app, self.limits, self.on_refused = app, limits, on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # (lower-case names, as ASGI gives them)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().decode("latin-1").lower()
        declared = headers.get(b"content-length")
        limit = self.limits.max_request_bytes
        if kind and kind not in _JSON and not kind.endswith("+json"):
            return await self._refuse(send, 415, "content_type", f"the request body must be JSON (Content-Type: "
                                      f"application/json), got Content-Type {kind[:60]!r}", "unsupported_media_type")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, 413, "too_large", f"the request body is {int(declared)} bytes; this "
                                      f"gateway takes at most {limit} (--max-request-bytes)", "request_too_large")
        chunks, size = [], 0
        while True:  # (the protocol bounds the time it may take: --body-timeout)
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left, or the protocol refused it: nothing to answer here
            size += len(message.get("body", b""))
            if size > limit:  # a chunked body (a Content-Length the parser holds the client to was checked above)
                return await self._refuse(send, 413, "too_large", f"the request body is over {limit} bytes, "
                                          f"the most this gateway takes (--max-request-bytes)", "request_too_large")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed, body
            if replayed:
                return await receive()  # what comes after the body: a disconnect
            replayed = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, send, status: int, reason: str, message: str, code: str) -> None:
        self.on_refused(reason)
        payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), _CLOSE]})
        await send({"type": "http.response.body", "body": payload})
