"""RemoteReplica: the controller's side of a replica whose Engine and EngineLoop run in a host process of their own
(cluster/replica_host.py, a Ray actor). It keeps the `Replica` interface (start/stop, admit, abort, submit, stats,
state, load, executor_facts; on_step / on_failure / on_state on the event loop), so the controller and the router
do not know where a replica's engine runs.

    hosts.start(replica_id, config, build_engine, ...) -> a Ray actor handle running ReplicaHost
    hosts.kill(handle)                                    -> the host process ends (its TP group with it)

What crosses to the host: admissions and aborts, gathered per turn of the event loop into one call each
(admit_many, abort_many); submit(fn) pickles fn. What comes back: one long-poll call at a time (next_events), each
carrying every step report, state change and failure queued since the last, so the controller's cost per step is
the report's dispatch plus a share of one call. A host that dies (its call raises) turns the replica FAILED: its
live streams end with UNAVAILABLE (their clients resume them on the other replicas) and the replica turns
RECOVERING while a new host starts in the background (restart_tries tries with backoff, as for a lost TP group;
admissions to it wait meanwhile); when every try fails, or restart_tries is 0, it turns FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.engine_loop import StepReport
from shardserve.cluster.executor import WorkerError
from shardserve.cluster.replica import ReplicaBase, ReplicaLoad, ReplicaState
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig

log = logging.getLogger(__name__)


class ReplicaHostLost(WorkerError):
    """The replica's host process died or stopped answering."""


class RemoteReplica(ReplicaBase):
    def __init__(self, *args, hosts: Any = None, **kwargs) -> None:
        """ReplicaBase's arguments; hosts: start(replica_id, config, build_engine, health_s, tries, backoff_s) ->
        a host actor handle, kill(handle)."""
        super().__init__(*args, **kwargs)
        self.engine = None  # in the host process
        self.tokenizer = None  # a copy of the host engine's, for the prompt encoder
        self._settings = (self._health_interval_s, self._restart_tries, self._restart_backoff_s)
        self._hosts = hosts
        self._host = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: asyncio.Task | None = None
        self._admits: list[tuple[tuple, asyncio.Future]] = []
        self._aborts: list[tuple[str, Future]] = []
        self._host_restarts = 0  # hosts replaced after dying (num_restarts adds the current host's group restarts)
        self._host_back: asyncio.Event | None = None  # set while a host serves (or the replica has failed)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the host process and, in it, the engine; raises what that raised (the replica is then FAILED)."""
        assert self.state in (ReplicaState.STOPPED, ReplicaState.FAILED), f"{self.id} is {self.state.value}"
        self._loop = asyncio.get_running_loop()
        self.state, self.error, self.load = ReplicaState.STARTING, None, ReplicaLoad()
        host = None
        try:
            host = self._host = await asyncio.to_thread(
                self._hosts.start, self.id, self.engine_config, self._build, *self._settings)
            info = await host.start.remote()
        except BaseException as e:
            if self.state is ReplicaState.STARTING:  # not stop()ped meanwhile (which ends the host itself)
                log.exception("replica %s: starting its host failed", self.id)
                self.state, self.error = ReplicaState.FAILED, e
            if host is not None:
                self._hosts.kill(host)
            if self._host is host:
                self._host = None
            raise
        if self.state is not ReplicaState.STARTING or self._host is not host:  # stopped meanwhile
            self._hosts.kill(host)
            if self._host is host:
                self._host = None
            return
        self._serve(host, info)

    def _serve(self, host, info: dict) -> None:
        self._host = host
        self.tokenizer = info["tokenizer"]
        self.load.num_kv_blocks = self.load.num_free_blocks = info["num_kv_blocks"]
        self.state, self.error = ReplicaState.SERVING, None
        self._host_back = self._host_back or asyncio.Event()
        self._host_back.set()
        self._pump = asyncio.create_task(self._read_events(host))

    def _host_lost(self, host, error: BaseException) -> None:
        """The host process died, its engine and every request on it with it: the controller ends those requests
        (on_failure: UNAVAILABLE, so their clients resume them elsewhere; the replica is RECOVERING by then, so the
        server does not count it as failed) and a new host starts in the background."""
        tries = self._settings[1]
        if tries <= 0:
            return self.fail(error)
        self._host = None
        self._host_back.clear()
        self.state, self.error = ReplicaState.RECOVERING, error
        self._fail_admits(error)
        self._on_failure(self, error)
        self._on_state(self)
        asyncio.create_task(self._replace_host(host, error))

    async def _replace_host(self, lost, error: BaseException) -> None:
        _, tries, wait_s = self._settings
        await asyncio.to_thread(self._hosts.kill, lost)  # its placement group too: the new host needs the room
        for attempt in range(1, tries + 1):
            if self.state is not ReplicaState.RECOVERING:  # stopped meanwhile
                return
            host = None
            try:
                host = await asyncio.to_thread(
                    self._hosts.start, self.id, self.engine_config, self._build, *self._settings)
                info = await host.start.remote()
            except Exception as e:
                log.exception("replica %s: starting a new host, try %d of %d, failed", self.id, attempt, tries)
                error = e
                if host is not None:
                    await asyncio.to_thread(self._hosts.kill, host)
                if attempt < tries:
                    await asyncio.sleep(wait_s)  # backoff before the next try, as a lost TP group's restart
                    wait_s = min(2 * wait_s, 15.0)
                continue
            if self.state is not ReplicaState.RECOVERING:  # stopped meanwhile
                await asyncio.to_thread(self._hosts.kill, host)
                return
            self._host_restarts += 1
            self.num_restarts = self._host_restarts
            log.warning("replica %s: a new host process serves it (host restart %d)", self.id, self._host_restarts)
            self._serve(host, info)
            self._on_state(self)
            return
        self.fail(ReplicaHostLost(f"the host process of replica {self.id} could not be restarted in {tries} "
                                  f"tries: {error}"))

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the host's engine loop and engine (its group), then ends the host process. Idempotent."""
        self.state = ReplicaState.STOPPED
        host, self._host = self._host, None
        if self._host_back is not None:
            self._host_back.set()  # admissions waiting for a new host go on, and fail
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
        if host is None:
            return
        try:
            await asyncio.wait_for(host.stop.remote(timeout_s), timeout_s + 10)
        except (Exception, asyncio.TimeoutError):
            log.warning("replica %s: its host did not stop cleanly; ending it", self.id)
        self._hosts.kill(host)

    def fail(self, error: BaseException) -> None:
        if self.state not in (ReplicaState.SERVING, ReplicaState.RECOVERING):
            return
        self.state, self.error = ReplicaState.FAILED, error
        if self._host_back is not None:
            self._host_back.set()  # admissions waiting for a new host go on, and fail
        self._fail_admits(error)
        self._on_failure(self, error)

    def _fail_admits(self, error: BaseException) -> None:
        for _, future in self._admits:
            if not future.done():
                future.set_exception(RuntimeError(f"replica {self.id} failed: {error}"))
        self._admits = []

    async def _read_events(self, host) -> None:
        while True:
            try:
                events = await host.next_events.remote()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the host process died (or its actor failed)
                if self._host is host and self.state in (ReplicaState.SERVING, ReplicaState.RECOVERING):
                    log.error("replica %s: its host process is gone: %s", self.id, e)
                    self._host_lost(host, ReplicaHostLost(f"the host process of replica {self.id} is gone: {e}"))
                return
            if self._host is not host:
                return
            for event in events:
                if event[0] == "step":
                    self._note_step(event[1])
                    self._on_step(self, event[1])
                elif event[0] == "state":
                    _, value, error, group_restarts = event
                    self.num_restarts = self._host_restarts + group_restarts
                    state = ReplicaState(value)
                    if state in (ReplicaState.RECOVERING, ReplicaState.SERVING) and self.state is not state \
                            and self.state in (ReplicaState.RECOVERING, ReplicaState.SERVING):
                        self.state = state
                        self.error = WorkerError(error) if error else self.error
                        self._on_state(self)
                elif event[0] == "failed":
                    self.fail(WorkerError(event[1]))

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Runs fn(engine) on the host's engine thread (fn is pickled): a concurrent Future of its result."""
        future: Future = Future()
        if self._host is None or self.state not in (ReplicaState.SERVING, ReplicaState.RECOVERING):
            future.set_exception(RuntimeError(f"replica {self.id} is {self.state.value}"))
            return future

        async def settle(ref) -> None:
            try:
                ok, value = await ref
            except Exception as e:
                ok, value = False, RuntimeError(f"replica {self.id}: its host failed: {e}")
            if future.set_running_or_notify_cancel():
                future.set_result(value) if ok else future.set_exception(value)

        self._loop.create_task(settle(self._host.submit.remote(fn)))
        return future

    async def admit(self, req_id: str, token_ids: list[int], params: SamplingParams, text: str | None = None,
                    resumed=()) -> None:
        """Engine.admit in the host; the admissions of one turn of the event loop travel as one call. While a
        new host starts (RECOVERING without a host) it waits for it."""
        if self._host is None and self.state is ReplicaState.RECOVERING:
            await self._host_back.wait()
        if self._host is None or self.state not in (ReplicaState.SERVING, ReplicaState.RECOVERING):
            raise RuntimeError(f"replica {self.id} is {self.state.value}")
        future = self._loop.create_future()
        self._admits.append(((req_id, token_ids, params, text, tuple(resumed)), future))
        if len(self._admits) == 1:
            self._loop.call_soon(self._send_admits)
        await future

    def _send_admits(self) -> None:
        batch, self._admits = self._admits, []
        if not batch or self._host is None:
            return

        async def settle(ref) -> None:
            try:
                results = await ref
            except Exception as e:
                results = [RuntimeError(f"replica {self.id}: its host failed: {e}")] * len(batch)
            for (_, future), error in zip(batch, results):
                if not future.done():
                    future.set_result(None) if error is None else future.set_exception(error)

        self._loop.create_task(settle(self._host.admit_many.remote([admission for admission, _ in batch])))

    def abort(self, req_id: str) -> Future:
        """Engine.abort in the host: a concurrent Future of whether the request was live there."""
        future: Future = Future()
        if self._host is None:
            future.set_exception(RuntimeError(f"replica {self.id} is {self.state.value}"))
            return future
        self._aborts.append((req_id, future))
        if len(self._aborts) == 1:
            self._loop.call_soon(self._send_aborts)
        return future

    def _send_aborts(self) -> None:
        batch, self._aborts = self._aborts, []
        if not batch:
            return

        async def settle() -> None:
            try:
                if self._host is None:
                    raise RuntimeError("stopped")
                found = await self._host.abort_many.remote([req_id for req_id, _ in batch])
            except Exception as e:
                found = None
                error = RuntimeError(f"replica {self.id}: its host failed: {e}")
            for i, (_, future) in enumerate(batch):
                if future.set_running_or_notify_cancel():
                    future.set_result(found[i]) if found is not None else future.set_exception(error)

        self._loop.create_task(settle())

    async def stats(self) -> EngineStats:
        if self._host is None:
            raise RuntimeError(f"replica {self.id} is {self.state.value}")
        return await self._host.stats.remote()

    async def executor_facts(self) -> dict:
        if self._host is None:
            return dict(nodes=[], group=None, forward_s=0.0)
        return await self._host.executor_facts.remote()
