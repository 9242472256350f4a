"""Controller: one engine replica behind the client-facing gRPC service (cluster/generation_service.py).
`shardserve serve` runs it as a Ray actor (an asyncio actor: its methods run on the actor's event loop); tests may
also run it in their own event loop.

Threads: the event loop serves gRPC (Generate streams, health, stats) and never blocks; the EngineLoop thread owns
the Engine and runs its steps (which block on the workers), then hands each step's deltas back to the event loop,
where they go into one asyncio queue per live request. Lifecycle: STARTING (health NOT_SERVING while the workers
load) -> SERVING -> DRAINING (SIGTERM: no new requests, in-flight ones may finish) -> STOPPED; FAILED when a
worker fails (health NOT_SERVING, every live stream ends with UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.cluster.admission import Prompt, has_chat_template
from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.engine_loop import EngineLoop, StepReport
from shardserve.cluster.errors import ServerOverloaded, ServerUnavailable, UnknownRequest
from shardserve.cluster.generation_service import set_health, start_server
from shardserve.cluster.metrics import ControllerMetrics
from shardserve.cluster.outputs import RequestDelta
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig
from shardserve.proto.transport import host_port

log = logging.getLogger(__name__)


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ServedModel:
    """The model facts clients see in GetModelInfo."""

    name: str
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None


@dataclass
class ControllerConfig:
    engine: EngineConfig
    model: ServedModel
    # Runs in the controller, off its event loop: loads the tokenizer, connects to the workers (returning once
    # every rank has loaded and allocated its cache) and builds the Engine. `shardserve serve` passes
    # shardserve/engine_factory.py's EngineFactory, the one engine wiring LLM and the benchmarks use too.
    build_engine: Callable[[EngineConfig], Engine]
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    metrics_port: int | None = None  # None = no /metrics endpoint; 0 = any free port
    replica: str = "replica-0"  # named in every stream's last message
    health_check_interval_s: float = 5.0  # how often the workers are asked, so an idle server notices a dead rank
    max_live_requests: int = 4096  # admission limit: beyond it Generate answers RESOURCE_EXHAUSTED (read per call)


@dataclass(slots=True)
class StreamItem:
    delta: RequestDelta


@dataclass
class LiveRequest:
    req_id: str
    queue: asyncio.Queue  # StreamItem, or an exception that ends the stream
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0


class Controller:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.state = State.STARTING
        self.metrics = ControllerMetrics(config.model.name)
        self.address: str | None = None
        self.metrics_address: str | None = None
        self.has_chat_template = False
        self._started_at = time.time()
        self._live: dict[str, LiveRequest] = {}
        self._idle = asyncio.Event()  # set while no request is live (drain waits on it)
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None
        self._engine: Engine | None = None
        self._server = None
        self._health = None
        self._load_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._load_error: BaseException | None = None
        self._failure: BaseException | None = None
        self.num_rejected = 0
        self.num_aborted = 0

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serves gRPC at once (health NOT_SERVING) and loads the engine in the background; returns host:port."""
        self._loop = asyncio.get_running_loop()
        self._server, port, self._health = await start_server(self, self.config.host, self.config.port)
        self.address = host_port(self.config.host, port)
        if self.config.metrics_port is not None:
            bound = self.metrics.serve(self.config.host, self.config.metrics_port)
            self.metrics_address = f"{self.config.host}:{bound}"
        self._load_task = asyncio.create_task(self._load())
        return self.address

    async def _load(self) -> None:
        try:
            engine = await asyncio.to_thread(self.config.build_engine, self.config.engine)
        except BaseException as e:
            log.exception("loading the engine failed")
            self._load_error = e
            self.state = State.FAILED
            return
        if self.state is not State.STARTING:  # shut down while loading
            await asyncio.to_thread(engine.shutdown)
            return
        self._engine = engine
        self.has_chat_template = has_chat_template(engine.tokenizer)
        self._engine_loop = EngineLoop(engine, self._on_step_threadsafe, self._on_failure_threadsafe)
        self._engine_loop.start()
        self.state = State.SERVING
        await self._set_health(True)
        if hasattr(engine.executor, "health"):
            self._watch_task = asyncio.create_task(self._watch_workers(engine.executor))

    async def _watch_workers(self, executor) -> None:
        """Asks every rank for its health now and then (between two steps, on the engine thread); a rank that is
        not READY or does not answer fails the replica, as a failed step would."""
        while self.state in (State.SERVING, State.DRAINING):
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                ranks = await asyncio.wrap_future(self._engine_loop.submit(lambda engine: executor.health()))
            except Exception:
                return  # the engine loop stopped or failed: that path reports it
            bad = [r for r in ranks if not r.ready]
            if bad and self.state in (State.SERVING, State.DRAINING):
                await self._fail(RuntimeError("; ".join(f"rank {r.rank} is {r.state} {r.error}".strip() for r in bad)))
                return

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once SERVING; False on timeout; raises RuntimeError when loading failed."""
        if self._load_task is None:
            raise RuntimeError("start() was not called")
        try:
            await asyncio.wait_for(asyncio.shield(self._load_task), timeout)
        except asyncio.TimeoutError:
            return False
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
        cut = list(self._live)
        for req_id in cut:
            self._end(req_id, ServerUnavailable(f"the server shut down before request {req_id} finished "
                                                f"(aborted after a {grace_s:g} s drain)"), outcome="abort")
            if self._engine_loop is not None:
                self._engine_loop.submit(lambda engine, r=req_id: engine.abort(r))
        return len(cut)

    async def shutdown(self, grace_s: float = 30.0) -> int:
        """Drains, stops the engine loop and the workers, then the servers. Returns drain()'s count."""
        cut = await self.drain(grace_s)
        self.state = State.STOPPED
        if self._engine_loop is not None:
            await asyncio.to_thread(self._engine_loop.stop, 30.0)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
        for task in (self._load_task, self._watch_task):
            if task is not None and not task.done():
                task.cancel()
        if self._server is not None:
            await self._server.stop(1.0)
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
                "live_requests": len(self._live), "error": repr(error) if error else None}

    # ---- requests -------------------------------------------------------------------------------------------
    async def add_request(self, prompt: Prompt, params: SamplingParams, req_id: str | None = None) -> LiveRequest:
        """Admits a request (Engine.admit, on the engine thread). Raises ValueError for bad input, ServerUnavailable
        when not serving, ServerOverloaded beyond max_live_requests."""
        try:
            if self.state is not State.SERVING:
                raise ServerUnavailable(f"the server is {self.state.value}, not accepting requests")
            if len(self._live) >= self.config.max_live_requests:
                raise ServerOverloaded(f"{len(self._live)} requests are live, the limit is "
                                       f"{self.config.max_live_requests}: retry later")
            req_id = req_id if req_id is not None else uuid.uuid4().hex
            if req_id in self._live:
                raise ValueError(f"request id {req_id!r} is already in use")
            live = LiveRequest(req_id, asyncio.Queue())
            self._live[req_id] = live  # before the engine sees it, so that no delta can miss its queue
            self._idle.clear()
            future = self._engine_loop.submit(lambda engine: engine.admit(req_id, prompt, params))
            try:
                live.num_prompt_tokens = await asyncio.wrap_future(future)
            except BaseException as e:
                self._forget(req_id)
                if isinstance(e, asyncio.CancelledError):  # the client left while we waited: undo the add
                    self._engine_loop.submit(lambda engine: engine.abort(req_id))
                elif not isinstance(e, ValueError):  # the engine loop died meanwhile
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
        if req_id not in self._live or self._engine_loop is None:
            raise UnknownRequest(req_id)
        if not await asyncio.wrap_future(self._engine_loop.submit(lambda engine: engine.abort(req_id))):
            raise UnknownRequest(req_id)

    def cancel(self, req_id: str) -> None:
        """The client went away: abort without waiting (the blocks are freed by the engine's next step)."""
        if req_id in self._live:
            self._end(req_id, None, outcome="abort")
            self._engine_loop.submit(lambda engine: engine.abort(req_id))

    async def server_stats(self) -> tuple[EngineStats | None, dict]:
        """Fresh engine stats (taken between two steps) and the controller's own counters."""
        stats = None
        if self._engine_loop is not None and self.state in (State.SERVING, State.DRAINING):
            stats = await asyncio.wrap_future(self._engine_loop.submit(lambda engine: engine.stats()))
        return stats, {"requests_aborted": self.num_aborted, "requests_rejected": self.num_rejected,
                       "uptime_s": time.time() - self._started_at}

    # ---- from the engine thread -----------------------------------------------------------------------------
    def _on_step_threadsafe(self, report: StepReport) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, report)

    def _on_failure_threadsafe(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._fail(error)))

    def _dispatch(self, report: StepReport) -> None:
        self.metrics.step_time.observe(report.step_s)
        self.metrics.observe_stats(report.stats)
        now = time.perf_counter()
        for delta in report.deltas:
            self.metrics.observe_delta(delta)
            live = self._live.get(delta.request_id)
            if live is None:  # cancelled by its client, or cut off by a drain
                continue
            if delta.token_ids:
                live.first_token_at = live.first_token_at or now
                live.last_token_at = now
            live.queue.put_nowait(StreamItem(delta))
            if delta.finished:
                self._end(delta.request_id, None, outcome=delta.finish_reason or "stop", num=delta.num_generated)

    async def _fail(self, error: BaseException) -> None:
        self._failure = error
        if self.state in (State.SERVING, State.DRAINING):
            self.state = State.FAILED
        await self._set_health(False)
        for req_id in list(self._live):
            self._end(req_id, ServerUnavailable(f"a worker failed: {error}"), outcome="error")

    def _end(self, req_id: str, error: BaseException | None, outcome: str, num: int = 0) -> None:
        """Forgets a live request; puts `error` into its stream first, if given."""
        live = self._live.get(req_id)
        if live is None:
            return
        if error is not None:
            live.queue.put_nowait(error)
        if outcome == "abort":
            self.num_aborted += 1
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

