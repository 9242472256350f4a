"""The gateway's HTTP connections: uvicorn's httptools protocol (its C parser) with the limits it lacks.

uvicorn bounds the keep-alive idle time (timeout_keep_alive) and nothing else a connection can hold: httptools takes
headers of any size, no timer runs while a request's headers or body trickle in (every byte resets the keep-alive
timer), and its concurrency limit answers in plain text, uncounted. GatewayProtocol adds, per GatewayLimits
(shardserve/gateway/request_limits.py):
- the request line and headers at most max_header_bytes (431), counted as they arrive: a header that never ends is
  refused at the limit, not buffered;
- header_timeout_s from the connection's opening (or the next request's first byte) to the end of the headers:
  past it 408 and closed (a connection that sent nothing is closed without a word);
- body_timeout_s from the end of the headers to the end of the body: 408 and closed (a body shorter than its
  Content-Length, a trickle);
- max_connections open at once in this process: a request on a connection opened past it is answered 503 and the
  connection closed.
Each refusal is an OpenAI error body, counted by reason (on_refused), and closes the connection.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from shardserve.gateway.openai_format import error_body


def protocol_class(limits, on_refused, on_open) -> type:
    """The protocol uvicorn runs (Config(http=...)) for one gateway: its limits, on_refused(reason) counting each
    refusal, on_open(+1 / -1) each connection opened and closed."""
    return type("GatewayProtocol", (GatewayProtocol,), {"limits": limits, "on_refused": staticmethod(on_refused),
                                                        "on_open": staticmethod(on_open)})


class GatewayProtocol(HttpToolsProtocol):
    limits = None  # GatewayLimits (set by protocol_class)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reading_headers = True  # between requests too: the next bytes are a request line
        self._header_bytes = 0  # bytes received since the last request ended (the next one's line and headers)
        self._timer = None  # the header or the body deadline
        self._refused = False  # answered and closing: read nothing more
        self._over_capacity = False

    # ---- the connection -----------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.on_open(1)
        self._over_capacity = len(self.connections) > self.limits.max_connections
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.on_open(-1)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_headers:
            self._header_bytes += len(data)
            if self._timer is None:  # a keep-alive connection's next request begins (uvicorn's idle timer ends)
                self._arm(self.limits.header_timeout_s, self._header_timeout)
        super().data_received(data)
        if self._reading_headers and not self._refused and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, "header_too_large", "the request line and headers are over "
                         f"{self.limits.max_header_bytes} bytes (--max-header-bytes)", "request_header_too_large")

    # ---- the parser's callbacks ---------------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._reading_headers = False
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:  # (all of them came in one read)
            return self._refuse(431, "header_too_large", f"the request line and headers are {size} bytes, over "
                                f"{self.limits.max_header_bytes} (--max-header-bytes)", "request_header_too_large")
        if self._over_capacity:
            return self._refuse(503, "over_capacity", f"this gateway process has {len(self.connections)} "
                                f"connections open, more than its limit of {self.limits.max_connections} "
                                "(--max-connections): try again", "over_capacity")
        self._arm(self.limits.body_timeout_s, self._body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._reading_headers, self._header_bytes = True, 0
        super().on_message_complete()

    # ---- deadlines and refusals ---------------------------------------------------------------------------------
    def _arm(self, seconds: float, then) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if not self._header_bytes:  # nothing came: no request to answer
            self._refuse(None, "header_timeout", "", "")
        else:
            self._refuse(408, "header_timeout", f"the request line and headers did not arrive within "
                         f"{self.limits.header_timeout_s:g} s (--header-timeout)", "timeout")

    def _body_timeout(self) -> None:
        self._timer = None
        answered = self.cycle is not None and self.cycle.response_started
        self._refuse(None if answered else 408, "body_timeout", f"the request body did not arrive within "
                     f"{self.limits.body_timeout_s:g} s of its headers (--body-timeout)", "timeout")

    def _refuse(self, status: int | None, reason: str, message: str, code: str) -> None:
        """Answers `status` (None: nothing) with an OpenAI error body and closes the connection; the request's app,
        if it runs, sees the client gone."""
        self._refused = True
        self._disarm()
        self.on_refused(reason)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.transport.is_closing():
            return
        if status is not None:
            kind = {408: "timeout_error", 503: "service_unavailable_error"}.get(status, "invalid_request_error")
            payload = json.dumps(error_body(message, kind, None, code)).encode()
            head = [STATUS_LINE[status]] + [name + b": " + value + b"\r\n"
                                            for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(payload),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + payload)
        self.transport.close()
