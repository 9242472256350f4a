"""Why the controller refuses or ends a request, besides bad input (a ValueError, from cluster/admission.py or
SamplingParams). Each front end maps them to its own status codes: the gRPC Generation service
(cluster/generation_service.py: status_of), and so would an HTTP gateway. And how a message shows what it refuses:
a bounded excerpt of the value (excerpt) and a bounded length (bounded), however large the request was."""

from __future__ import annotations

import reprlib


class ServerUnavailable(RuntimeError):
    """Not serving now: starting, draining, stopped, or a worker failed (gRPC UNAVAILABLE)."""


class ServerOverloaded(RuntimeError):
    """max_live_requests requests are live already (gRPC RESOURCE_EXHAUSTED): retry later or elsewhere."""


class UnknownRequest(KeyError):
    """No live request has this id (gRPC NOT_FOUND)."""


MAX_MESSAGE_BYTES = 1024  # a refusal's message at most: it travels in a gRPC status (headers: 8 KB in all)
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 2
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 40


def excerpt(value) -> str:
    """The offending value as an error message repeats it: its repr cut short (a few items of a list, the ends of
    a long string) and, for a container, how many entries it has: "['x', 'x', 'x', 'x', ...] (5000 entries)"."""
    shown = _SHOWN.repr(value)
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 4:
        shown += f" ({len(value)} entries)"
    return shown


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """message cut to `limit` bytes of UTF-8: a gRPC status past its metadata limit is lost, reason and all."""
    raw = message.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return message
    return raw[:limit - 40].decode("utf-8", "ignore") + f"... ({len(raw)} bytes in all)"
