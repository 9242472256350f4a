"""LocalReplica: one tensor-parallel group in this process (the Replica interface, cluster/replica.py): its Engine,
the EngineLoop thread that owns it, its state, its health and its load.

    replica = LocalReplica("serve-1a2b/0", engine_config, build_engine, on_step, on_failure)
    await replica.start()                         # build_engine(config) in a thread; STARTING -> SERVING | FAILED
    await replica.admit(req_id, token_ids, params)   # Engine.admit on the engine thread
    replica.abort(req_id)                         # a concurrent Future[bool]
    replica.state, replica.load                   # what the router weighs
    await replica.stop()                          # the loop stops, the engine (and its workers) shut down
    await replica.start()                         # a stopped or failed replica can start again (a new group)

`build_engine` is the group's factory: a callable EngineConfig -> Engine that runs off the event loop. Under
`shardserve serve` it places the group's placement group and worker actors itself (shardserve/launch/ray_serving.py:
RayGroupFactory), so starting again means a fresh group; the engine's shutdown takes the group down with it.

A lost group (a rank died, hung past the step deadline or failed a step) is replaced when restart_tries > 0: the
replica turns RECOVERING (on_state tells the controller: health), the engine loop starts a fresh group through
build_engine (only its executor is kept) with up to restart_tries tries and backoff, and the engine resumes every
live request on it (cluster/engine_loop.py, Engine.restart): streams see a pause. FAILED when every try failed.

Threads: the controller's event loop calls every method here; the engine thread calls on_step (a StepReport) and
reports failures, both handed over to the event loop: on_step(replica, report) and on_failure(replica, error) run
there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

from shardserve.cluster.admission import EncodedPrompt
from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.engine_loop import EngineLoop, RestartPolicy, StepReport
from shardserve.cluster.executor import WorkerError
from shardserve.cluster.replica import ReplicaBase, ReplicaLoad, ReplicaState
from shardserve.cluster.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LocalReplica(ReplicaBase):
    def __init__(self, *args, **kwargs) -> None:
        """ReplicaBase's arguments."""
        super().__init__(*args, **kwargs)
        self.engine: Engine | None = None  # touched on the engine thread only, through submit()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None
        self._watch_task: asyncio.Task | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Builds the engine (off the event loop) and starts its loop. Raises what building raised (the replica is
        then FAILED). A replica stop()ped while starting shuts the new engine down again."""
        assert self.state in (ReplicaState.STOPPED, ReplicaState.FAILED), f"{self.id} is {self.state.value}"
        self._loop = asyncio.get_running_loop()
        self.state, self.error, self.load = ReplicaState.STARTING, None, ReplicaLoad()
        try:
            engine = await asyncio.to_thread(self._build, self.engine_config)
        except BaseException as e:
            if isinstance(e, ValueError):  # settings the workers refused: their one-line message says it all
                log.error("replica %s: loading the engine failed: %s", self.id, e)
            else:
                log.exception("replica %s: loading the engine failed", self.id)
            self.state, self.error = ReplicaState.FAILED, e
            raise
        if self.state is not ReplicaState.STARTING:  # stopped meanwhile
            await asyncio.to_thread(engine.shutdown)
            return
        self.engine = engine
        self.load.num_kv_blocks = self.load.num_free_blocks = engine.num_kv_blocks
        self._engine_loop = EngineLoop(engine, self._step_threadsafe, self._failure_threadsafe, self._restart_policy())
        self._engine_loop.start()
        self.state = ReplicaState.SERVING
        if hasattr(engine.executor, "health"):
            self._watch_task = asyncio.create_task(self._watch_workers())

    def _restart_policy(self) -> RestartPolicy | None:
        if self._restart_tries < 1:
            return None
        build, config, loop = self._build, self.engine_config, self._loop
        return RestartPolicy(
            make_executor=lambda: build(config).executor,  # a fresh group; the rest of that Engine is dropped
            max_tries=self._restart_tries,
            backoff_s=self._restart_backoff_s,
            on_group_lost=lambda error: loop.call_soon_threadsafe(self._group_lost, error),
            on_group_back=lambda: loop.call_soon_threadsafe(self._group_back),
        )

    def _group_lost(self, error: BaseException) -> None:
        if self.state is ReplicaState.SERVING:
            log.error("replica %s: its TP group failed, starting a new one: %s", self.id, error)
            self.state, self.error = ReplicaState.RECOVERING, error
            self.num_restarts += 1
            self._on_state(self)

    def _group_back(self) -> None:
        if self.state is ReplicaState.RECOVERING:
            log.warning("replica %s: a new TP group serves", self.id)
            self.state = ReplicaState.SERVING
            self._on_state(self)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the engine loop after its current step, then shuts the engine (its workers) down. Idempotent."""
        self.state = ReplicaState.STOPPED
        if self._watch_task is not None and not self._watch_task.done():
            self._watch_task.cancel()
        engine_loop, engine = self._engine_loop, self.engine
        self._engine_loop = self.engine = None
        if engine_loop is not None:
            await asyncio.to_thread(engine_loop.stop, timeout_s)
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    def fail(self, error: BaseException) -> None:
        """Marks the replica FAILED (it gets nothing new) and tells the controller; the engine stays until stop()."""
        if self.state not in (ReplicaState.SERVING, ReplicaState.RECOVERING):
            return
        self.state, self.error = ReplicaState.FAILED, error
        self._on_failure(self, error)

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Runs fn(engine) on the engine thread between two steps."""
        if self._engine_loop is None:
            future: Future = Future()
            future.set_exception(RuntimeError(f"replica {self.id} is {self.state.value}"))
            return future
        return self._engine_loop.submit(fn)

    async def admit(self, req_id: str, token_ids: list[int], params: SamplingParams, text: str | None = None,
                    resumed=()) -> None:
        """Engine.admit on the engine thread (ValueError for a request that is malformed or can never fit).
        The prompt is already tokenized: the router needs its token ids (cluster/router.py). resumed: the tokens a
        resuming client already has (Engine.admit)."""
        encoded = EncodedPrompt(text, token_ids)
        await asyncio.wrap_future(self.submit(lambda engine: engine.admit(req_id, encoded, params, resumed)))

    def abort(self, req_id: str) -> Future:
        """Engine.abort on the engine thread: a Future of whether the request was live there."""
        return self.submit(lambda engine: engine.abort(req_id))

    async def stats(self) -> EngineStats:
        return await asyncio.wrap_future(self.submit(lambda engine: engine.stats()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else None

    async def executor_facts(self) -> dict:
        """The current group's facts: its rank nodes, its workers' own time in the steps so far (forward_s), its
        launcher.WorkerGroup (None where the executor has none) and the wall time of the engine's steps (step_s)."""
        executor = self.engine.executor if self.engine is not None else None
        return dict(nodes=list(getattr(executor, "node_ids", ())), group=getattr(executor, "group", None),
                    forward_s=getattr(executor, "forward_ms_total", 0.0) / 1e3, step_s=self.step_s_total)

    # ---- health ---------------------------------------------------------------------------------------------
    async def _watch_workers(self) -> None:
        """Asks every rank of the current group for its health now and then (between two steps, on the engine
        thread); a rank that is not READY or does not answer fails the group, as a failed step would."""
        engine_loop = self._engine_loop
        while self.state in (ReplicaState.SERVING, ReplicaState.RECOVERING):
            await asyncio.sleep(self._health_interval_s)
            try:
                ranks = await asyncio.wrap_future(
                    self.submit(lambda engine: [] if engine_loop.recovering else engine.executor.health()))
            except Exception:
                return  # the engine loop stopped or failed: that path reports it
            bad = [r for r in ranks if not r.ready]
            if bad and self.state is ReplicaState.SERVING:
                error = WorkerError("; ".join(f"rank {r.rank} is {r.state} {r.error}".strip() for r in bad))
                if self._restart_tries < 1:
                    self.fail(error)
                    return
                engine_loop.group_lost(error)

    # ---- from the engine thread -----------------------------------------------------------------------------
    def _step_threadsafe(self, report: StepReport) -> None:
        self._loop.call_soon_threadsafe(self._after_step, report)

    def _after_step(self, report: StepReport) -> None:
        self._note_step(report)
        self._on_step(self, report)

    def _failure_threadsafe(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self.fail, error)
