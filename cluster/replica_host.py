"""ReplicaHost: one replica's Engine and EngineLoop in a process of their own (a Ray actor), so that several
replicas' host work (scheduling, plans, result handling, detokenizing) runs on several cores, and so that the
streams of its requests go from here to the front process that admitted them (cluster/front.py), never through
the controller. Inside, the host runs a `LocalReplica` (cluster/local_replica.py): its engine thread, its health
watcher and its group restarts (the group factory runs here, so the group's actors are the host's and die with it).
Everyone else holds a RemoteReplica (cluster/remote_replica.py) over it.

    host = ReplicaHost(replica_id, engine_config, build_engine, health_check_interval_s, restart_tries, backoff_s)
    await host.start()                     # builds the engine (its TP group); returns the facts callers need
    await host.subscribe(sub, deltas)      # a front (deltas=True) or the controller (state changes only)
    await host.admit_many([...], sub)      # Engine.admit for each, in one engine-thread command
    await host.next_events(sub)            # every event queued for sub since its last call

Subscribers: each front gets the step reports with the deltas of the requests it admitted (and every step's stats
and block events, for its router); the controller gets state changes and failures only, so its work does not grow
with tokens. A request resumed through another front (its first front died) takes its id over: the old one is
aborted in the same engine command. A subscriber that has not asked for events for SUBSCRIBER_LEASE_S (its front
died) is dropped and the requests it admitted are aborted.

Threads (inside the host): the actor's event loop runs these methods and the inner replica's callbacks; the engine
thread steps. Events queue on the event loop and leave in batches: one `next_events` call carries every report
queued since the previous one, so a slow subscriber costs fewer calls, not more.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.cluster.admission import EncodedPrompt
from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.engine_loop import StepReport
from shardserve.cluster.local_replica import LocalReplica
from shardserve.proto.config import EngineConfig

GIL_SWITCH_INTERVAL_S = 0.0005  # as in the controller: an engine thread whose step came back waits less

# Events, in order: ("step", StepReport) | ("state", state value, error text, num_restarts) | ("failed", error text)
# | ("dropped",): the subscriber is unknown here (subscribe again)
# (errors travel as text: not every exception pickles)
Event = tuple


SUBSCRIBER_LEASE_S = 15.0


@dataclass
class _Subscriber:
    deltas: bool  # a front: step reports with its requests' deltas; else state changes and failures only
    events: list = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    polled_at: float = field(default_factory=time.monotonic)
    waiting: bool = False


class ReplicaHost:
    def __init__(self, replica_id: str, engine_config: EngineConfig, build_engine: Callable[[EngineConfig], Engine],
                 health_check_interval_s: float = 5.0, restart_tries: int = 3, restart_backoff_s: float = 1.0) -> None:
        self.replica = LocalReplica(replica_id, engine_config, build_engine, self._on_step, self._on_failure,
                                    health_check_interval_s, restart_tries, restart_backoff_s, self._on_state)
        self._subs: dict[str, _Subscriber] = {}
        self._owner: dict[str, str] = {}  # live request id -> the subscriber that admitted it
        self._superseded: set[str] = set()  # ids taken over by a resumed request: the old one's abort is dropped
        self._info: dict | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> dict:
        """Builds the engine and starts its loop; raises what building raised."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        await self.replica.start()
        engine = self.replica.engine
        self._info = {"num_kv_blocks": engine.num_kv_blocks, "tokenizer": engine.tokenizer}
        self._sweeper = asyncio.create_task(self._sweep())
        return self.info()

    def info(self) -> dict:
        """What a subscriber needs: the cache size, the tokenizer, the state (None before start() returned)."""
        if self._info is None:
            return None
        return dict(self._info, state=self.replica.state.value, num_restarts=self.replica.num_restarts)

    async def subscribe(self, sub: str, deltas: bool = True) -> dict | None:
        self._subs[sub] = _Subscriber(deltas)
        return self.info()

    async def stop(self, timeout_s: float = 30.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.replica.stop(timeout_s)
        self._push_all(("state", self.replica.state.value, None, self.replica.num_restarts))

    def pid(self) -> int:
        import os

        return os.getpid()

    # ---- commands (each one engine-thread command) ----------------------------------------------------------
    async def admit_many(self, admissions: list[tuple], sub: str = "") -> list[BaseException | None]:
        """Each (req_id, token_ids, params, text, resumed) through Engine.admit, in order, in one command on
        the engine thread; per admission None or the exception it raised (a ValueError belongs to that one). A
        request id that another subscriber's live request holds (a stream resumed through another front) is
        aborted there first."""
        taken = [a[0] for a in admissions if self._owner.get(a[0], sub) != sub]
        self._superseded.update(taken)  # their abort's final delta is not the new request's

        def add_all(engine: Engine) -> list:
            for req_id in taken:
                engine.abort(req_id)
                engine.pop_output(req_id)  # the id is free for the resumed request
            results = []
            for req_id, token_ids, params, text, resumed in admissions:
                try:
                    engine.admit(req_id, EncodedPrompt(text, token_ids), params, resumed)
                    results.append(None)
                except Exception as e:
                    results.append(e)
            return results

        # Owned before the engine thread admits them: its next step's deltas (the first token among them) may
        # reach _on_step before this coroutine resumes, and a delta without an owner goes to no front.
        for req_id, *_ in admissions:
            self._owner[req_id] = sub
        results = await asyncio.wrap_future(self.replica.submit(add_all))
        for (req_id, *_), error in zip(admissions, results):
            if error is not None and self._owner.get(req_id) == sub:
                del self._owner[req_id]
        return results
    async def abort_many(self, req_ids: list[str]) -> list[bool]:
        return await asyncio.wrap_future(self.replica.submit(lambda engine: [engine.abort(r) for r in req_ids]))

    async def submit(self, fn: Callable[[Engine], object]) -> tuple[bool, object]:
        """fn(engine) on the engine thread: (True, its result) or (False, the exception it raised)."""
        try:
            return True, await asyncio.wrap_future(self.replica.submit(fn))
        except Exception as e:
            return False, e

    async def stats(self) -> EngineStats:
        return await self.replica.stats()

    async def executor_facts(self) -> dict:
        return await self.replica.executor_facts()

    # ---- events to the subscribers --------------------------------------------------------------------------
    async def next_events(self, sub: str = "") -> list[Event]:
        """Waits until at least one event is queued for sub, then returns every queued one. An unknown (or
        dropped) subscriber gets a "dropped" event: it subscribes again."""
        s = self._subs.get(sub)
        if s is None:
            return [("dropped",)]
        s.waiting = True
        try:
            while not s.events and self._subs.get(sub) is s:
                s.wake.clear()
                await s.wake.wait()
        finally:
            s.waiting, s.polled_at = False, time.monotonic()
        if self._subs.get(sub) is not s:
            return [("dropped",)]
        events, s.events = s.events, []
        return events

    def _push_all(self, event: Event) -> None:
        for s in self._subs.values():
            s.events.append(event)
            s.wake.set()

    def _on_step(self, replica: LocalReplica, report: StepReport) -> None:
        by_sub: dict[str, list] = {}
        owner = self._owner
        for delta in report.deltas:
            if self._superseded and delta.finish_reason == "abort" and delta.request_id in self._superseded:
                self._superseded.discard(delta.request_id)
                continue
            sub = owner.get(delta.request_id)
            if delta.finished:
                owner.pop(delta.request_id, None)
            if sub is not None:
                by_sub.setdefault(sub, []).append(delta)
        for name, s in self._subs.items():
            if s.deltas:
                s.events.append(("step", StepReport(by_sub.get(name, []), report.step_s, report.stats,
                                                    report.block_events)))
                s.wake.set()

    def _on_state(self, replica: LocalReplica) -> None:
        self._push_all(("state", replica.state.value, _text(replica.error), replica.num_restarts))

    def _on_failure(self, replica: LocalReplica, error: BaseException) -> None:
        self._push_all(("failed", _text(error)))

    async def _sweep(self) -> None:
        """Drops subscribers that stopped asking (their process died) and aborts the requests they admitted."""
        while True:
            await asyncio.sleep(SUBSCRIBER_LEASE_S / 3)
            now = time.monotonic()
            gone = [name for name, s in self._subs.items() if not s.waiting and now - s.polled_at > SUBSCRIBER_LEASE_S]
            for name in gone:
                s = self._subs.pop(name)
                s.wake.set()
                orphans = [r for r, owner in self._owner.items() if owner == name]
                for r in orphans:
                    del self._owner[r]
                if orphans:
                    self.replica.submit(lambda engine, ids=orphans: [engine.abort(r) for r in ids])


def _text(error: BaseException | None) -> str | None:
    return None if error is None else str(error) or repr(error)
