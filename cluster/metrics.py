"""Prometheus metrics of one controller: request outcomes, token counts, queue and KV-cache gauges, latencies.

Each controller has its own registry (not prometheus_client's global one), so several controllers in one process
(tests) never collide, and /metrics shows exactly this controller's series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

# Seconds. CPU steps of the default model take ~0.05-1 s; GPU decode steps a few ms.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

OUTCOMES = ("stop", "length", "abort", "rejected", "error")


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shardserve_requests", "Requests by outcome: stop, length, abort, rejected (bad input or draining), "
            "error (worker failure)", ["outcome"], registry=r,
        )
        self.prompt_tokens = Counter("shardserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("shardserve_generation_tokens", "Generated tokens", registry=r)
        self.num_waiting = Gauge("shardserve_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.num_running = Gauge("shardserve_requests_running", "Requests in the running batch", registry=r)
        self.kv_blocks_total = Gauge("shardserve_kv_blocks_total", "KV-cache blocks", registry=r)
        self.kv_blocks_used = Gauge("shardserve_kv_blocks_used", "KV-cache blocks held by live requests", registry=r)
        self.kv_blocks_cached = Gauge(
            "shardserve_kv_blocks_cached", "KV-cache blocks findable by prefix lookup", registry=r
        )
        self.step_time = Histogram(
            "shardserve_step_seconds", "Engine step time (schedule, workers, outputs)", buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "shardserve_time_to_first_token_seconds", "From admission to the first generated token",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "shardserve_time_per_output_token_seconds", "Mean time per generated token after the first, per request",
            buckets=_TPOT_BUCKETS, registry=r,
        )
        for outcome in OUTCOMES:  # so that every series exists from the start, at 0
            self.requests.labels(outcome)
        self._http = None

    def observe_stats(self, stats) -> None:
        """Sets the gauges from an EngineStats."""
        self.num_waiting.set(stats.num_waiting)
        self.num_running.set(stats.num_running)
        self.kv_blocks_total.set(stats.num_kv_blocks)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.kv_blocks_cached.set(stats.num_kv_blocks_cached)

    def observe_finished(self, outcome: str, first_token_s: float | None, last_token_s: float | None,
                         num_generated: int) -> None:
        """A request ended. Times are seconds since its admission (None when no token came)."""
        self.requests.labels(outcome).inc()
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
            if num_generated > 1 and last_token_s is not None:
                self.tpot.observe((last_token_s - first_token_s) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Exposes /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
