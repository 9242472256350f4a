"""Controller: the engine replicas (cluster/replica.py) behind the client-facing gRPC service
(cluster/generation_service.py). `shardserve serve` runs it as a Ray actor (an asyncio actor: its methods run on the
actor's event loop); tests may also run it in their own event loop.

Threads: the event loop serves gRPC (Generate streams, health, stats) and never blocks; each replica's EngineLoop
thread owns its Engine and runs its steps (which block on the workers), then hands each step's deltas back to the
event loop, where they go into one asyncio queue per live request. Lifecycle: STARTING (health NOT_SERVING while
the replicas load) -> SERVING -> DRAINING (SIGTERM: no new requests, in-flight ones may finish) -> STOPPED; a
replica whose worker fails starts a new TP group (RECOVERING: its live requests wait, their streams see a pause;
cluster/replica.py) and, when that fails restart_tries times, ends its live streams with UNAVAILABLE and gets nothing
new; health is NOT_SERVING while no replica is SERVING, FAILED once none is serving or recovering.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
import time
import uuid

from shardserve.cluster.admission import Prompt, has_chat_template
from shardserve.cluster.controller_types import ControllerConfig, LiveRequest, ServedModel, State, StreamItem
from shardserve.cluster.controller_views import ControllerViews
from shardserve.cluster.engine_loop import StepReport
from shardserve.cluster.errors import ServerOverloaded, ServerUnavailable, UnknownRequest
from shardserve.cluster.generation_service import set_health, start_server
from shardserve.cluster.metrics import ControllerMetrics
from shardserve.cluster.prompt_encoder import PromptEncoder, default_max_prompt_bytes
from shardserve.cluster.remote_replica import RemoteReplica
from shardserve.cluster.replica import Replica, ReplicaState
from shardserve.cluster.router import ROUTE_BLOCKS, Router, prompt_block_hashes
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.transport import host_port

log = logging.getLogger(__name__)

# The engine threads, the event loop and gRPC share this process's GIL. A thread whose step just came back from the
# workers asks for the GIL and, at Python's default 5 ms switch interval, may wait that long behind the event loop's
# streaming while the GPU idles: a whole small-model decode step. Shorter turns cost a little switching instead.
GIL_SWITCH_INTERVAL_S = 0.0005
# At shutdown the gRPC server stops last, after the drain: a call that reached it just before is answered (refused
# with UNAVAILABLE) within this grace, and one still unanswered when it ends is cancelled (the client sees CANCELLED,
# not a status it can act on). On a loaded host answering can take more than a second; with no call open the stop
# returns at once, so a long grace costs nothing.
SERVER_STOP_GRACE_S = 10.0

__all__ = ["Controller", "ControllerConfig", "LiveRequest", "ServedModel", "State", "StreamItem"]


class Controller(ControllerViews):
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.state = State.STARTING
        self.metrics = ControllerMetrics(config.model.name)
        self.address: str | None = None
        self.metrics_address: str | None = None
        self.has_chat_template = False
        # With replica hosts, each replica's engine runs in a process of its own (cluster/remote_replica.py).
        make, extra = (Replica, {}) if config.replica_hosts is None else (RemoteReplica, {"hosts": config.replica_hosts})
        self.replicas = [
            make(f"{config.name}/{i}", config.engine, config.build_engine, self._dispatch, self._on_replica_failure,
                 config.health_check_interval_s, config.restart_tries, config.restart_backoff_s,
                 self._on_replica_state, **extra)
            for i in range(config.num_replicas)
        ]
        self._position = {r.id: i for i, r in enumerate(self.replicas)}
        self.router = Router(self.replicas, config.routing)
        self._started_at = time.time()
        self._live: dict[str, LiveRequest] = {}
        self._idle = asyncio.Event()  # set while no request is live (drain waits on it)
        self._idle.set()
        self._prompts: PromptEncoder | None = None  # tokenizes off the engine threads (a pool of its own)
        self._server = None
        self._health = None
        self._load_task: asyncio.Task | None = None
        self._load_error: BaseException | None = None
        self._failure: BaseException | None = None
        self.num_rejected = 0
        self.num_aborted = 0
        # Unseeded requests get their seed here, at admission, and the client is told it (Started.seed): a stream
        # resumed on another replica or a restarted controller then continues the same draw.
        self._seeds = random.Random(config.engine.seed)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serves gRPC at once (health NOT_SERVING) and loads the replicas in the background; returns host:port."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._server, port, self._health = await start_server(self, self.config.host, self.config.port,
                                                                  self.config.security)
        self.address = host_port(self.config.host, port)
        if self.config.metrics_port is not None:
            bound = self.metrics.serve(self.config.host, self.config.metrics_port)
            self.metrics_address = f"{self.config.host}:{bound}"
        self._load_task = asyncio.create_task(self._load())
        return self.address

    async def _load(self) -> None:
        """Starts every replica at once; serving needs all of them (a replica that fails to load fails the start)."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            self._load_error = errors[0]
            if self.state is State.STARTING:
                self.state = State.FAILED
            return
        if self.state is not State.STARTING:  # shut down while loading
            return
        tokenizer = self.replicas[0].tokenizer
        self._prompts = PromptEncoder(tokenizer, self.config.security.max_prompt_bytes
                                      or default_max_prompt_bytes(self.config.engine.max_model_len))
        self.has_chat_template = has_chat_template(tokenizer)
        self.state = State.SERVING
        await self._set_health(True)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once SERVING; False on timeout; raises when loading failed: ValueError for settings the workers
        refused (the message is theirs), else RuntimeError."""
        if self._load_task is None:
            raise RuntimeError("start() was not called")
        try:
            await asyncio.wait_for(asyncio.shield(self._load_task), timeout)
        except asyncio.TimeoutError:
            return False
        if isinstance(self._load_error, ValueError):
            raise ValueError(str(self._load_error)) from self._load_error
        if self._load_error is not None:
            raise RuntimeError(f"the engine failed to load: {self._load_error!r}") from self._load_error
        return self.state is State.SERVING

    async def drain(self, grace_s: float = 30.0) -> int:
        """Stops admitting, lets live requests finish within grace_s, then ends the rest with UNAVAILABLE.
        Returns how many were cut off."""
        if self.state in (State.STARTING, State.SERVING):
            self.state = State.DRAINING
        await self._set_health(False)
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

    async def shutdown(self, grace_s: float = 30.0) -> int:
        """Drains, stops the replicas (their engine loops and workers), then the servers. Returns drain()'s count."""
        cut = await self.drain(grace_s)
        self.state = State.STOPPED
        await asyncio.gather(*(r.stop(30.0) for r in self.replicas))
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self._prompts is not None:
            self._prompts.close()
        if self._server is not None:
            await self._server.stop(SERVER_STOP_GRACE_S)
        self.metrics.close()
        return cut

    async def _set_health(self, serving: bool) -> None:
        if self._health is not None:
            await set_health(self._health, serving)

    def pid(self) -> int:
        import os

        return os.getpid()

    def status(self) -> dict:
        error = self._failure or self._load_error
        return {"state": self.state.value, "address": self.address, "metrics_address": self.metrics_address,
                "live_requests": len(self._live), "error": repr(error) if error else None,
                "replicas": {r.id: r.state.value for r in self.replicas},
                "routed": dict(zip(self._position, self.router.num_routed)),
                "group_restarts": sum(r.num_restarts for r in self.replicas)}

    # ---- requests -------------------------------------------------------------------------------------------
    def _unavailable(self) -> ServerUnavailable:
        cause = f" ({self._failure})" if self.state is State.FAILED and self._failure else ""
        return ServerUnavailable(f"the server is {self.state.value}{cause}, not accepting requests")

    def _route(self, token_ids: list[int]) -> Replica:
        hashes = (prompt_block_hashes(token_ids, self.config.engine.block_size, ROUTE_BLOCKS)
                  if self.router.policy == "cache-aware" else ())
        try:
            return self.replicas[self.router.route(hashes)[0]]
        except LookupError as e:
            raise ServerUnavailable(str(e)) from None

    async def add_request(self, prompt: Prompt, params: SamplingParams, req_id: str | None = None,
                          resumed: list[int] | None = None, echo: bool = False) -> LiveRequest:
        """Admits a request: its prompt tokenized on the PromptEncoder's pool (off every engine thread), routed to a
        replica, then Engine.add_request on that replica's engine thread. Raises ValueError for bad input,
        ServerUnavailable when not serving, ServerOverloaded beyond max_live_requests. resumed: the tokens a resumed
        stream already has (Engine.add_request). echo: the live request keeps the prompt as text and its first
        token's (decoded on the pool)."""
        try:
            if self.state is not State.SERVING:
                raise self._unavailable()
            if len(self._live) >= self.config.max_live_requests:
                raise ServerOverloaded(f"{len(self._live)} requests are live, the limit is "
                                       f"{self.config.max_live_requests}: retry later")
            req_id = req_id if req_id is not None else uuid.uuid4().hex
            if req_id in self._live:
                raise ValueError(f"request id {req_id!r} is already in use")
            if params.seed is None:
                params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
            live = LiveRequest(req_id, asyncio.Queue(), seed=params.seed, final_only=params.final_only)
            self._live[req_id] = live  # first: the id is taken while the prompt is tokenized
            self._idle.clear()
            try:
                text, token_ids = await self._prompts.encode(prompt)
                if echo:
                    live.prompt_text, live.prompt_first_token_text = await self._prompts.echo_texts(text, token_ids)
                if self.state is not State.SERVING:
                    raise self._unavailable()
                live.replica = replica = self._route(token_ids)
                max_new = params.max_tokens if params.max_tokens is not None else self.config.engine.max_model_len - len(token_ids)
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
                elif not isinstance(e, (ValueError, ServerUnavailable, asyncio.CancelledError)):  # the engine loop died meanwhile
                    raise ServerUnavailable(f"the engine failed: {e!r}") from e
                raise
        except (ValueError, ServerUnavailable, ServerOverloaded):
            self.note_rejected()
            raise
        self.metrics.prompt_tokens.inc(live.num_prompt_tokens)
        return live

    def note_rejected(self) -> None:
        self.num_rejected += 1
        self.metrics.requests.labels("rejected").inc()

    async def abort(self, req_id: str) -> None:
        """Ends a live request with finish reason ABORT. Raises UnknownRequest when no live request has the id."""
        live = self._live.get(req_id)
        if live is None or live.replica is None:
            raise UnknownRequest(req_id)
        try:
            found = await asyncio.wrap_future(live.replica.abort(req_id))
        except RuntimeError as e:
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

    # ---- from the replicas (on the event loop) --------------------------------------------------------------
    def _dispatch(self, replica: Replica, report: StepReport) -> None:
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

    def _on_replica_state(self, replica: Replica) -> None:
        """A replica's group failed (RECOVERING) or is back (SERVING): health follows whether any replica serves.
        A new group starts with an empty cache, so the router forgets what the lost one held."""
        if replica.state is ReplicaState.RECOVERING:
            self.router.forget(self._position[replica.id])
        if self.state is State.SERVING:
            asyncio.ensure_future(self._set_health(any(r.serving for r in self.replicas)))

    def _on_replica_failure(self, replica: Replica, error: BaseException) -> None:
        """A replica failed for good, or lost its host process (RECOVERING then: a new one is starting): its live
        requests end with UNAVAILABLE; the server fails once no replica is serving or recovering."""
        self._failure = error
        self.router.forget(self._position[replica.id])
        for live in [live for live in self._live.values() if live.replica is replica]:
            self._end(live.req_id, ServerUnavailable(f"a worker failed: {error}"), outcome="error")
        alive = any(r.state in (ReplicaState.SERVING, ReplicaState.RECOVERING) for r in self.replicas)
        if not alive and self.state in (State.SERVING, State.DRAINING):
            self.state = State.FAILED
        if self.state in (State.SERVING, State.FAILED):
            asyncio.ensure_future(self._set_health(any(r.serving for r in self.replicas)))

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
