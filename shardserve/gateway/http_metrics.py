"""The HTTP gateway's own Prometheus metrics (GET /metrics): requests by endpoint and status, latency, time to the
first token, tokens, client disconnects, refusals by the gateway's own limits, open connections. Each gateway has a
registry of its own, so that several in one process (tests, `serve --http-port` next to a standalone one) do not
collide; the server's engine metrics stay on the server's --metrics-port. A gateway of several processes (--workers)
has one registry per process, and a scrape gets the counts of whichever process accepts its connection (no
multi-process aggregation yet)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("shardserve:gateway_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.in_flight = Gauge("shardserve:gateway_requests_in_flight", "generation requests being answered",
                               registry=r)
        self.latency = Histogram("shardserve:gateway_request_duration_seconds",
                                 "generation requests: arrival to last byte", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram("shardserve:gateway_time_to_first_token_seconds",
                              "streamed requests: arrival to the first generated text", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("shardserve:gateway_prompt_tokens", "prompt tokens of answered requests",
                                     registry=r)
        self.completion_tokens = Counter("shardserve:gateway_completion_tokens",
                                         "tokens generated for answered requests", registry=r)
        self.disconnects = Counter("shardserve:gateway_client_disconnects",
                                   "requests whose client left before the end (aborted upstream)", registry=r)
        self.upstream_errors = Counter("shardserve:gateway_upstream_errors", "gRPC errors from the server, by code",
                                       ["code"], registry=r)
        self.refused = Counter("shardserve_gateway_refused", "requests and connections refused by the gateway's own "
                               "limits (request_limits.py), by reason: too_large, content_type, header_too_large, "
                               "header_timeout, body_timeout, over_capacity", ["reason"], registry=r)
        self.connections = Gauge("shardserve_gateway_connections_open", "HTTP connections open in this process",
                                 registry=r)

    def connection(self, change: int) -> None:
        self.connections.inc(change)

    def refused_for(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
