"""Front: the client API's request side over a set of replicas (the Replica interface): the Generation gRPC server
(cluster/generation_service.py, which talks to it as a GenerationBackend), tokenizing, routing (cluster/router.py,
its prefix index fed by the replicas' block events), admission limits, one asyncio queue per live request, and the
streams' deltas from the replicas' step reports. With replica hosts each front is a process of its own
(cluster/front_process.py; several share one port) talking to every host directly: a token passes through one
process between its engine and its client, and the controller never sees one. Without hosts the controller holds
one Front over its in-process replicas. Lifecycle: STARTING (health NOT_SERVING) -> SERVING (ready()) -> DRAINING
-> STOPPED; FAILED once no replica is serving or recovering. Everything here runs on one event loop, never blocking.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from shardserve.cluster.admission import Prompt, Seeds, has_chat_template
from shardserve.cluster.controller_types import FrontSettings, LiveRequest, State, StreamItem
from shardserve.cluster.controller_views import summed_stats
from shardserve.cluster.engine import EngineStats
from shardserve.cluster.engine_loop import StepReport
from shardserve.cluster.errors import ServerOverloaded, ServerUnavailable, UnknownRequest
from shardserve.cluster.generation_service import ModelFacts, set_health, start_server
from shardserve.cluster.metrics import ControllerMetrics
from shardserve.cluster.prompt_encoder import PromptEncoder, default_max_prompt_bytes
from shardserve.cluster.replica import Replica, ReplicaState
from shardserve.cluster.router import POLICIES, Router
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.transport import host_port


class Front:
    def __init__(self, settings: FrontSettings, metrics: ControllerMetrics | None = None) -> None:
        self.settings = settings
        self.stream_interval = settings.stream_interval
        self.max_live_requests = settings.max_live_requests
        self.state = State.STARTING
        self.metrics = metrics or ControllerMetrics(settings.model.name)
        self.address: str | None = None
        self.has_chat_template = False
        self.replicas: list[Replica] = []
        self.router = Router([], settings.routing)
        self._position: dict[str, int] = {}
        self._live: dict[str, LiveRequest] = {}
        self._idle = asyncio.Event()  # set while no request is live (drain waits on it)
        self._idle.set()
        self._prompts: PromptEncoder | None = None  # tokenizes off the engine threads (a pool of its own)
        self._server = None
        self._health = None
        self.failure: BaseException | None = None
        self.started_at = time.time()
        self.num_rejected = 0
        self.num_aborted = 0
        # Unseeded requests get their seed here, at admission, and the client is told it (Started.seed): a stream
        # resumed on another replica, front or a restarted controller then continues the same draw.
        self._seeds = Seeds(settings.engine.seed)

    def attach(self, replicas: list[Replica]) -> None:
        """The replicas this front routes to (their callbacks are on_step, on_replica_failure, on_replica_state)."""
        self.replicas = list(replicas)
        self._position = {r.id: i for i, r in enumerate(self.replicas)}
        self.router = Router(self.replicas, self.router.policy)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start_server(self) -> str:
        """Serves gRPC at once (health NOT_SERVING until ready()); returns host:port."""
        s = self.settings
        self._server, port, self._health = await start_server(self, s.host, s.port, s.security)
        self.address = host_port(s.host, port)
        return self.address

    async def ready(self, tokenizer) -> None:
        """The replicas serve: tokenizing starts, health turns SERVING."""
        if self.state is not State.STARTING:
            return
        self._prompts = PromptEncoder(tokenizer, self.settings.security.max_prompt_bytes
                                      or default_max_prompt_bytes(self.settings.engine.max_model_len),
                                      grammar_vocab=(self.settings.engine.tokenizer, self.settings.model.vocab_size))
        self.has_chat_template = has_chat_template(tokenizer)
        self.state = State.SERVING
        await self.set_health(any(r.serving for r in self.replicas))

    async def drain(self, grace_s: float = 30.0) -> int:
        """Stops admitting, lets live requests finish within grace_s, then ends the rest with UNAVAILABLE.
        Returns how many were cut off."""
        if self.state in (State.STARTING, State.SERVING):
            self.state = State.DRAINING
        await self.set_health(False)
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            pass
        cut = list(self._live.values())
        for live in cut:
            self._end(live.req_id, ServerUnavailable(f"the server shut down before request {live.req_id} finished "
                                                     f"(aborted after a {grace_s:g} s drain)"), outcome="abort")
            if live.replica is not None:
                live.replica.abort(live.req_id)
        return len(cut)

    async def close(self, grace_s: float) -> None:
        """After drain(): the tokenizer pool and the gRPC server stop."""
        self.state = State.STOPPED
        if self._prompts is not None:
            self._prompts.close()
        if self._server is not None:
            await self._server.stop(grace_s)

    async def set_health(self, serving: bool) -> None:
        if self._health is not None:
            await set_health(self._health, serving)

    def model_facts(self) -> ModelFacts:
        s = self.settings
        return ModelFacts(s.engine, s.model, s.num_replicas, self.has_chat_template)

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- requests (the GenerationBackend interface) ---------------------------------------------------------
    def _unavailable(self) -> ServerUnavailable:
        cause = f" ({self.failure})" if self.state is State.FAILED and self.failure else ""
        return ServerUnavailable(f"the server is {self.state.value}{cause}, not accepting requests")

    def _route(self, token_ids: list[int]) -> Replica:
        try:
            return self.replicas[self.router.route_prompt(token_ids, self.settings.engine.block_size)[0]]
        except LookupError as e:
            raise ServerUnavailable(str(e)) from None

    async def add_request(self, prompt: Prompt, params: SamplingParams, req_id: str | None = None,
                          resumed: list[int] | None = None, echo: bool = False) -> LiveRequest:
        """Admits a request: its prompt tokenized on the PromptEncoder's pool, routed to a replica, then
        Engine.admit there. Raises ValueError for bad input, ServerUnavailable when not serving,
        ServerOverloaded beyond max_live_requests. resumed: the tokens a resumed stream already has
        (Engine.admit). echo: the live request keeps the prompt as text and its first token's."""
        try:
            if self.state is not State.SERVING:
                raise self._unavailable()
            if len(self._live) >= self.max_live_requests:
                raise ServerOverloaded(f"{len(self._live)} requests are live, the limit is "
                                       f"{self.max_live_requests}: retry later")
            req_id = req_id if req_id is not None else uuid.uuid4().hex
            if req_id in self._live:
                raise ValueError(f"request id {req_id!r} is already in use")
            params = self._seeds.fill(params)
            live = LiveRequest(req_id, asyncio.Queue(), seed=params.seed, final_only=params.final_only)
            self._live[req_id] = live  # first: the id is taken while the prompt is tokenized
            self._idle.clear()
            try:
                text, token_ids = await self._prompts.encode(prompt)
                if params.structured_outputs is not None:  # compiled off the engine thread, which then finds it cached
                    self.metrics.grammar_compile_time.observe(await self._prompts.compile_grammar(params))
                if echo:
                    live.prompt_text, live.prompt_first_token_text = await self._prompts.echo_texts(text, token_ids)
                if self.state is not State.SERVING:
                    raise self._unavailable()
                live.replica = replica = self._route(token_ids)
                max_new = (params.max_tokens if params.max_tokens is not None
                           else self.settings.engine.max_model_len - len(token_ids))
                live.cost = len(token_ids) + max(0, max_new)  # counted now: the next request's route sees it
                replica.load.admitted(live.cost)
                live.num_prompt_tokens = len(token_ids)
                await replica.admit(req_id, token_ids, params, text, resumed or ())
            except BaseException as e:
                if self._live.get(req_id) is live and live.cost:
                    live.replica.load.finished(live.cost)
                self._forget(req_id)
                if isinstance(e, asyncio.CancelledError) and live.replica is not None:  # the client left while
                    live.replica.abort(req_id)  # we waited: undo the add
                elif not isinstance(e, (ValueError, ServerUnavailable, asyncio.CancelledError)):  # the engine died
                    raise ServerUnavailable(f"the engine failed: {e!r}") from e
                raise
        except (ValueError, ServerUnavailable, ServerOverloaded):
            self.note_rejected()
            raise
        self.metrics.prompt_tokens.inc(live.num_prompt_tokens)
        if params.structured_outputs is not None:
            self.metrics.structured_requests.inc()
        return live

    def note_rejected(self) -> None:
        self.num_rejected += 1
        self.metrics.requests.labels("rejected").inc()

    async def abort(self, req_id: str) -> None:
        """Ends a live request with finish reason ABORT. Raises UnknownRequest when no live request has the id
        (here; a request another front admitted is aborted by its replica, which every front can reach)."""
        live = self._live.get(req_id)
        targets = [live.replica] if live is not None and live.replica is not None else \
            [r for r in self.replicas if r.serving or r.recovering]
        found = False
        for replica in targets:
            try:
                found = await asyncio.wrap_future(replica.abort(req_id)) or found
            except RuntimeError as e:
                if live is not None:
                    raise ServerUnavailable(str(e)) from e
        if not found:
            raise UnknownRequest(req_id)

    def cancel(self, req_id: str) -> None:
        """The client went away: abort without waiting (the blocks are freed by the engine's next step)."""
        live = self._live.get(req_id)
        if live is not None:
            self._end(req_id, None, outcome="abort")
            if live.replica is not None:
                live.replica.abort(req_id)

    async def server_stats(self) -> tuple[EngineStats | None, dict]:
        """Fresh engine stats summed over the serving replicas (None when not serving) and this front's counters,
        with each replica's id, state, requests routed here and stats."""
        stats, replicas = await summed_stats(self.replicas, self.router.num_routed,
                                             self.state in (State.SERVING, State.DRAINING))
        return stats, {"requests_aborted": self.num_aborted, "requests_rejected": self.num_rejected,
                       "uptime_s": time.time() - self.started_at, "replicas": replicas}

    # ---- what the controller asks of a front ----------------------------------------------------------------
    def routed(self) -> list[int]:
        """Requests routed to each replica by this front."""
        return list(self.router.num_routed)

    def reset_routing(self, policy: str | None = None) -> None:
        """Forgets the prefix index (the replicas' caches were emptied) and switches the policy (None: kept)."""
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        for i in range(len(self.replicas)):
            self.router.forget(i)
        if policy is not None:
            self.router.policy = policy

    # ---- from the replicas (on the event loop) --------------------------------------------------------------
    def on_step(self, replica: Replica, report: StepReport) -> None:
        if report.block_events:
            self.router.apply_events(self._position[replica.id], report.block_events)
        self.metrics.step_time.observe(report.step_s)
        self.metrics.observe_stats(report.stats, replica.id)
        now = time.perf_counter()
        for delta in report.deltas:
            self.metrics.observe_delta(delta)
            live = self._live.get(delta.request_id)
            if live is None:  # cancelled by its client, or cut off by a drain
                continue
            if delta.error is not None:  # e.g. too big for the cache of a group that came back smaller
                self._end(delta.request_id, ServerOverloaded(delta.error), outcome="error")
                continue
            if delta.token_ids:
                if not live.final_only:  # its one delta says when it ended, not when its first token came
                    live.first_token_at = live.first_token_at or now
                live.last_token_at = now
            live.queue.put_nowait(StreamItem(delta))
            if delta.finished:
                self._end(delta.request_id, None, outcome=delta.finish_reason or "stop", num=delta.num_generated)

    def on_replica_state(self, replica: Replica) -> None:
        """A replica's group failed (RECOVERING) or is back (SERVING): health follows whether any replica serves.
        A new group starts with an empty cache, so the router forgets what the lost one held."""
        if replica.state is ReplicaState.RECOVERING:
            self.router.forget(self._position[replica.id])
        if self.state is State.SERVING:
            asyncio.ensure_future(self.set_health(any(r.serving for r in self.replicas)))

    def on_replica_failure(self, replica: Replica, error: BaseException) -> None:
        """A replica failed for good, or lost its host process (RECOVERING then: a new one is starting): its live
        requests end with UNAVAILABLE; the front fails once no replica is serving or recovering."""
        self.failure = error
        self.router.forget(self._position[replica.id])
        for live in [live for live in self._live.values() if live.replica is replica]:
            self._end(live.req_id, ServerUnavailable(f"a worker failed: {error}"), outcome="error")
        alive = any(r.state in (ReplicaState.SERVING, ReplicaState.RECOVERING) for r in self.replicas)
        if not alive and self.state in (State.SERVING, State.DRAINING):
            self.state = State.FAILED
        if self.state in (State.SERVING, State.FAILED):
            asyncio.ensure_future(self.set_health(any(r.serving for r in self.replicas)))

    def _end(self, req_id: str, error: BaseException | None, outcome: str, num: int = 0) -> None:
        """Forgets a live request; puts `error` into its stream first, if given."""
        live = self._live.get(req_id)
        if live is None:
            return
        if error is not None:
            live.queue.put_nowait(error)
        if outcome == "abort":
            self.num_aborted += 1
        if live.cost:
            live.replica.load.finished(live.cost)
        base = live.admitted_at
        self.metrics.observe_finished(
            outcome,
            None if live.first_token_at is None else live.first_token_at - base,
            None if live.last_token_at is None else live.last_token_at - base,
            num,
        )
        self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self._live.pop(req_id, None)
        if not self._live:
            self._idle.set()

