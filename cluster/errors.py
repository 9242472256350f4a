"""Why the controller refuses or ends a request, besides bad input (a ValueError, from cluster/admission.py or
SamplingParams). Each front end maps them to its own status codes: the gRPC Generation service
(cluster/generation_service.py: status_of), and so would an HTTP gateway."""

from __future__ import annotations


class ServerUnavailable(RuntimeError):
    """Not serving now: starting, draining, stopped, or a worker failed (gRPC UNAVAILABLE)."""


class ServerOverloaded(RuntimeError):
    """max_live_requests requests are live already (gRPC RESOURCE_EXHAUSTED): retry later or elsewhere."""


class UnknownRequest(KeyError):
    """No live request has this id (gRPC NOT_FOUND)."""
