"""Prometheus metrics of one controller, named and typed as vLLM's (`vllm:` -> `shardserve:`): request outcomes,
token counters, queue and KV-cache gauges (usage as a fraction), prefix-cache queries and hits (tokens), and the
latency histograms operators chart: end-to-end, queue time, time to first token, time per output token.

Every series carries a `model_name` label (the name GetModelInfo reports). Gauges never end in `_total` and no
`_created` series is exported (prometheus_client's created samples are turned off for the process). Each controller
has its own registry (not prometheus_client's global one), so several controllers in one process (tests) never
collide, and /metrics shows exactly this controller's series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import start_http_server

disable_created_metrics()

# Seconds. CPU steps of the default model take ~0.05-1 s; GPU decode steps a few ms.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

OUTCOMES = ("stop", "length", "abort", "rejected", "error")


class _ByOutcome:
    """The requests counter with this controller's model_name already applied: .labels(outcome)."""

    def __init__(self, counter: Counter, model_name: str) -> None:
        self._counter, self._model_name = counter, model_name

    def labels(self, outcome: str):
        return self._counter.labels(model_name=self._model_name, outcome=outcome)


class ControllerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def one(kind, name: str, doc: str, **options):
            return kind(f"shardserve:{name}", doc, m, registry=r, **options).labels(model_name=model_name)

        self.requests = _ByOutcome(Counter(
            "shardserve:requests", "Requests by outcome: stop, length, abort, rejected (bad input or draining), "
            "error (worker failure)", m + ["outcome"], registry=r,
        ), model_name)
        self.prompt_tokens = one(Counter, "prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = one(Counter, "generation_tokens", "Generated tokens")
        self.prefix_cache_queries = one(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = one(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.spec_drafts = one(Counter, "spec_decode_num_drafts", "Speculative verification rows (drafts proposed)")
        self.spec_draft_tokens = one(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted_tokens = one(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._spec_per_pos = Counter("shardserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Drafts accepted up to and including each draft position", m + ["position"],
                                     registry=r)
        self._model_name = model_name
        self._spec_seen: dict[str, tuple] = {}
        self.num_waiting = one(Gauge, "num_requests_waiting", "Requests waiting to be scheduled")
        self.num_running = one(Gauge, "num_requests_running", "Requests in the running batch")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.kv_blocks = one(Gauge, "kv_cache_blocks", "KV-cache blocks")
        self.kv_blocks_used = one(Gauge, "kv_cache_blocks_used", "KV-cache blocks held by live requests")
        self.kv_blocks_cached = one(Gauge, "kv_cache_blocks_cached", "KV-cache blocks findable by prefix lookup")
        self.step_time = one(Histogram, "engine_step_seconds", "Engine step time (schedule, workers, outputs)",
                             buckets=_STEP_BUCKETS)
        self.e2e = one(Histogram, "e2e_request_latency_seconds", "From admission to the last generated token",
                       buckets=_REQUEST_BUCKETS)
        self.queue_time = one(Histogram, "request_queue_time_seconds", "From admission to first being scheduled",
                              buckets=_REQUEST_BUCKETS)
        self.ttft = one(Histogram, "time_to_first_token_seconds", "From admission to the first generated token",
                        buckets=_TTFT_BUCKETS)
        self.tpot = one(Histogram, "time_per_output_token_seconds",
                        "Mean time per generated token after the first, per request", buckets=_TPOT_BUCKETS)
        self.structured_requests = one(Counter, "structured_output_requests",
                                       "Admitted requests with structured_outputs (a schema, regex, choice, grammar)")
        self.grammar_compile_time = one(Histogram, "grammar_compile_seconds",
                                        "Compiling a request's grammar at admission (a cached one: its look-up)",
                                        buckets=_GRAMMAR_BUCKETS)
        self.grammar_mask_time = one(Histogram, "grammar_mask_seconds",
                                     "Host time of a step's structured-output masks (steps with a constrained row)",
                                     buckets=_GRAMMAR_BUCKETS)
        for outcome in OUTCOMES:  # so that every series exists from the start, at 0
            self.requests.labels(outcome)
        # Per replica: its latest EngineStats (the gauges sum them) and the cumulative (prompt tokens, cached prompt
        # tokens) last seen (the counters advance by the difference).
        self._latest: dict[str, object] = {}
        self._prefix_seen: dict[str, tuple[int, int]] = {}
        self._http = None

    def observe_stats(self, stats, replica: str = "") -> None:
        """Sets the gauges from the replicas' latest EngineStats (summed over replicas) and advances the
        prefix-cache counters by what this replica's stats add."""
        self._latest[replica] = stats
        latest = self._latest.values()
        self.num_waiting.set(sum(s.num_waiting for s in latest))
        self.num_running.set(sum(s.num_running for s in latest))
        blocks = sum(s.num_kv_blocks for s in latest)
        used = sum(s.num_kv_blocks_used for s in latest)
        self.kv_usage.set(used / blocks if blocks else 0.0)
        self.kv_blocks.set(blocks)
        self.kv_blocks_used.set(used)
        self.kv_blocks_cached.set(sum(s.num_kv_blocks_cached for s in latest))
        queries, hits = stats.num_prompt_tokens, stats.num_cached_prompt_tokens
        seen_queries, seen_hits = self._prefix_seen.get(replica, (0, 0))
        self.prefix_cache_queries.inc(max(queries - seen_queries, 0))
        self.prefix_cache_hits.inc(max(hits - seen_hits, 0))
        self._prefix_seen[replica] = (queries, hits)
        if getattr(stats, "grammar_mask_s", 0.0) > 0.0:
            self.grammar_mask_time.observe(stats.grammar_mask_s)
        self._observe_speculation(stats, replica)

    def _observe_speculation(self, stats, replica: str) -> None:
        """Advances the spec_decode counters by what this replica's cumulative counts add."""
        now = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
               stats.spec_accepted_per_pos)
        seen = self._spec_seen.get(replica, (0, 0, 0, ()))
        if now == seen:
            return
        self.spec_drafts.inc(max(now[0] - seen[0], 0))
        self.spec_draft_tokens.inc(max(now[1] - seen[1], 0))
        self.spec_accepted_tokens.inc(max(now[2] - seen[2], 0))
        for position, count in enumerate(now[3]):
            before = seen[3][position] if position < len(seen[3]) else 0
            self._spec_per_pos.labels(model_name=self._model_name, position=str(position)).inc(max(count - before, 0))
        self._spec_seen[replica] = now

    def observe_delta(self, delta) -> None:
        """A RequestDelta: its tokens, and its queue time (on a request's first delta)."""
        self.generation_tokens.inc(len(delta.token_ids))
        if delta.queue_time_s is not None:
            self.queue_time.observe(delta.queue_time_s)

    def observe_finished(self, outcome: str, first_token_s: float | None, last_token_s: float | None,
                         num_generated: int) -> None:
        """A request ended. Times are seconds since its admission (None when no token came; a final-only
        request has no first-token time: its tokens came all at once)."""
        self.requests.labels(outcome).inc()
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
            if num_generated > 1 and last_token_s is not None:
                self.tpot.observe((last_token_s - first_token_s) / (num_generated - 1))
        if last_token_s is not None:
            self.e2e.observe(last_token_s)

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
