"""RemoteReplica: the `Replica` interface (cluster/replica.py) over a replica host process (cluster/replica_host.py,
a Ray actor running the replica's Engine and EngineLoop), so that neither the front nor the controller knows where a
replica's engine runs. Two sides hold one: the controller (it starts, replaces and ends the host: OwnedHosts, and
subscribes to state changes only) and each front process (it finds the host by the replica's name: FoundHosts, and
subscribes to its own requests' deltas); cluster/host_sources.py.

What crosses to the host: admissions and aborts, gathered per turn of the event loop into one call each
(admit_many, abort_many); submit(fn) pickles fn. What comes back: one long-poll call at a time (next_events), each
carrying every event queued for this subscriber since the last. A host that dies (its call raises) turns the replica
RECOVERING: its live streams end with UNAVAILABLE (on_failure; their clients resume them on the other replicas)
while a new host starts (the controller) or is waited for (a front); admissions to it wait meanwhile; when that
fails, or restart_tries is 0, it turns FAILED.
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
from shardserve.cluster.host_sources import OwnedHosts
from shardserve.cluster.replica import ReplicaBase, ReplicaLoad, ReplicaState
from shardserve.cluster.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ReplicaHostLost(WorkerError):
    """The replica's host process died or stopped answering."""


class RemoteReplica(ReplicaBase):
    def __init__(self, *args, hosts: Any = None, subscriber: str = "control", deltas: bool = False,
                 source: Any = None, **kwargs) -> None:
        """ReplicaBase's arguments. source: where the host comes from (cluster/host_sources.py; default: OwnedHosts
        over the launcher `hosts`). subscriber, deltas: this side's subscription (a front: its id, True)."""
        super().__init__(*args, **kwargs)
        self.engine = None  # in the host process
        self.tokenizer = None  # a copy of the host engine's, for the prompt encoder
        self._source = source or OwnedHosts(hosts, self.engine_config, self._build,
                                            (self._health_interval_s, self._restart_tries, self._restart_backoff_s))
        self._sub, self._deltas = subscriber, deltas
        self._host = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: asyncio.Task | None = None
        self._admits: list[tuple[tuple, asyncio.Future]] = []
        self._aborts: list[tuple[str, Future]] = []
        self._host_back: asyncio.Event | None = None  # set while a host serves (or the replica has failed)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts (or finds) the host process and, in it, the engine; raises what that raised (then FAILED)."""
        assert self.state in (ReplicaState.STOPPED, ReplicaState.FAILED), f"{self.id} is {self.state.value}"
        self._loop = asyncio.get_running_loop()
        self.state, self.error, self.load = ReplicaState.STARTING, None, ReplicaLoad()
        try:
            host, info = await self._source.first(self.id)
            info = await host.subscribe.remote(self._sub, self._deltas) or info
        except BaseException as e:
            if self.state is ReplicaState.STARTING:
                log.exception("replica %s: starting its host failed", self.id)
                self.state, self.error = ReplicaState.FAILED, e
            raise
        if self.state is not ReplicaState.STARTING:  # stopped meanwhile
            if self._source.owns:
                await self._source.release(host, 5.0, self.id)
            return
        self._serve(host, info)

    def _serve(self, host, info: dict) -> None:
        self._host = host
        self.tokenizer = info["tokenizer"]
        self.num_restarts = self._source.num_replaced + info.get("num_restarts", 0)
        self.load.num_kv_blocks = self.load.num_free_blocks = info["num_kv_blocks"]
        self.state, self.error = ReplicaState(info.get("state", "serving")), None
        self._host_back = self._host_back or asyncio.Event()
        self._host_back.set()
        self._pump = asyncio.create_task(self._read_events(host))

    def _host_lost(self, host, error: BaseException) -> None:
        """The host process died, its engine and every request on it with it: their streams end (on_failure:
        UNAVAILABLE, so their clients resume them elsewhere; the replica is RECOVERING by then, so nobody counts it
        as failed) and a new host is started (or, in a front, waited for) in the background."""
        if self._restart_tries <= 0:
            return self.fail(error)
        self._host = None
        self._host_back.clear()
        self.state, self.error = ReplicaState.RECOVERING, error
        self._fail_admits(error)
        self._on_failure(self, error)
        self._on_state(self)
        asyncio.create_task(self._replace_host(host))

    async def _replace_host(self, lost) -> None:
        try:
            host, info = await self._source.replace(self.id, lost, lambda: self.state is ReplicaState.RECOVERING)
            info = await host.subscribe.remote(self._sub, self._deltas) or info
        except Exception as e:
            if self.state is ReplicaState.RECOVERING:
                self.fail(ReplicaHostLost(str(e)))
            return
        if self.state is not ReplicaState.RECOVERING:  # stopped meanwhile
            if self._source.owns:
                await self._source.release(host, 5.0, self.id)
            return
        log.warning("replica %s: a new host process serves it", self.id)
        self._serve(host, info)
        self._on_state(self)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the host's engine loop and engine (its group), then ends the host process (the controller's side;
        a front's only stops listening). Idempotent."""
        self.state = ReplicaState.STOPPED
        host, self._host = self._host, None
        if self._host_back is not None:
            self._host_back.set()  # admissions waiting for a new host go on, and fail
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
        if host is not None:
            await self._source.release(host, timeout_s, self.id)

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
                events = await host.next_events.remote(self._sub)
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
                kind = event[0]
                if kind == "step":
                    self._note_step(event[1])
                    self._on_step(self, event[1])
                elif kind == "state":
                    _, value, error, group_restarts = event
                    self.num_restarts = self._source.num_replaced + group_restarts
                    state = ReplicaState(value)
                    if state in (ReplicaState.RECOVERING, ReplicaState.SERVING) and self.state is not state \
                            and self.state in (ReplicaState.RECOVERING, ReplicaState.SERVING):
                        self.state = state
                        self.error = WorkerError(error) if error else self.error
                        self._on_state(self)
                elif kind == "failed":
                    self.fail(WorkerError(event[1]))
                elif kind == "dropped":  # the host forgot us (we stopped asking for too long): our requests there
                    error = ReplicaHostLost(f"replica {self.id} dropped this front's requests")  # were aborted
                    self._on_failure(self, error)
                    await host.subscribe.remote(self._sub, self._deltas)

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

        self._loop.create_task(settle(self._host.admit_many.remote([admission for admission, _ in batch], self._sub)))

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
            return dict(nodes=[], group=None, forward_s=0.0, step_s=0.0)
        return await self._host.executor_facts.remote()
