"""ReplicaHost: one replica's Engine and EngineLoop in a process of their own (a Ray actor), so that several
replicas' host work (scheduling, plans, result handling, detokenizing) runs on several cores instead of sharing
the controller's GIL. The controller talks to it through RemoteReplica (cluster/remote_replica.py), which keeps the
`Replica` interface; inside, the host runs a `LocalReplica` (cluster/local_replica.py): its engine thread, its
health watcher and its group restarts (the group factory runs here, so the group's actors are the host's and die
with it).

    host = ReplicaHost(replica_id, engine_config, build_engine, health_check_interval_s, restart_tries, backoff_s)
    await host.start()           # builds the engine (its TP group); returns the facts the controller needs
    await host.admit_many([...]) # Engine.admit for each, in one engine-thread command; errors come back
    await host.next_events()     # every step report, state change and failure queued since the last call

Threads (inside the host): the actor's event loop runs these methods and the inner LocalReplica's callbacks; the engine
thread steps. Events queue on the event loop and leave in batches: one `next_events` call carries every step
report queued since the previous one, so a slow controller costs fewer calls, not more.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from shardserve.cluster.admission import EncodedPrompt
from shardserve.cluster.engine import Engine, EngineStats
from shardserve.cluster.engine_loop import StepReport
from shardserve.cluster.local_replica import LocalReplica
from shardserve.proto.config import EngineConfig

GIL_SWITCH_INTERVAL_S = 0.0005  # as in the controller: an engine thread whose step came back waits less

# Events, in order: ("step", StepReport) | ("state", state value, error text, num_restarts) | ("failed", error text)
# (errors travel as text: not every exception pickles)
Event = tuple


class ReplicaHost:
    def __init__(self, replica_id: str, engine_config: EngineConfig, build_engine: Callable[[EngineConfig], Engine],
                 health_check_interval_s: float = 5.0, restart_tries: int = 3, restart_backoff_s: float = 1.0) -> None:
        self.replica = LocalReplica(replica_id, engine_config, build_engine, self._on_step, self._on_failure,
                               health_check_interval_s, restart_tries, restart_backoff_s, self._on_state)
        self._events: list[Event] = []
        self._wake: asyncio.Event | None = None

    async def start(self) -> dict:
        """Builds the engine and starts its loop; raises what building raised."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._wake = asyncio.Event()
        await self.replica.start()
        engine = self.replica.engine
        return {"num_kv_blocks": engine.num_kv_blocks, "tokenizer": engine.tokenizer}

    async def stop(self, timeout_s: float = 30.0) -> None:
        await self.replica.stop(timeout_s)
        self._push(("state", self.replica.state.value, None, self.replica.num_restarts))

    def pid(self) -> int:
        import os

        return os.getpid()

    # ---- commands (each one engine-thread command) ----------------------------------------------------------
    async def admit_many(self, admissions: list[tuple]) -> list[BaseException | None]:
        """Each (req_id, token_ids, params, text, resumed) through Engine.admit, in order, in one command on
        the engine thread; per admission None or the exception it raised (a ValueError belongs to that one)."""
        def add_all(engine: Engine) -> list:
            results = []
            for req_id, token_ids, params, text, resumed in admissions:
                try:
                    engine.admit(req_id, EncodedPrompt(text, token_ids), params, resumed)
                    results.append(None)
                except Exception as e:
                    results.append(e)
            return results

        return await asyncio.wrap_future(self.replica.submit(add_all))

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

    # ---- events to the controller ---------------------------------------------------------------------------
    async def next_events(self) -> list[Event]:
        """Waits until at least one event is queued, then returns every queued one."""
        while not self._events:
            self._wake.clear()
            await self._wake.wait()
        events, self._events = self._events, []
        return events

    def _push(self, event: Event) -> None:
        self._events.append(event)
        if self._wake is not None:
            self._wake.set()

    def _on_step(self, replica: LocalReplica, report: StepReport) -> None:
        self._push(("step", report))

    def _on_state(self, replica: LocalReplica) -> None:
        self._push(("state", replica.state.value, _text(replica.error), replica.num_restarts))

    def _on_failure(self, replica: LocalReplica, error: BaseException) -> None:
        self._push(("failed", _text(error)))


def _text(error: BaseException | None) -> str | None:
    return None if error is None else str(error) or repr(error)
