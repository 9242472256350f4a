"""Replica: what a front process (cluster/front.py) and the controller ask of one tensor-parallel group's engine,
wherever that engine runs. Two implementations: LocalReplica (cluster/local_replica.py: the Engine and its
EngineLoop thread in this process) and RemoteReplica (cluster/remote_replica.py: the Engine in a replica host
process, cluster/replica_host.py). The router (cluster/router.py) reads only `id`, `load`, `serving` and
`recovering`, so it does not know which one it weighs either.

    await replica.start()                            # STOPPED | FAILED -> STARTING -> SERVING (or FAILED, raising)
    await replica.admit(req_id, token_ids, params)   # Engine.admit on the engine's thread
    replica.abort(req_id)                            # a concurrent Future[bool]: was it live there
    replica.submit(fn)                               # fn(engine) between two steps: a concurrent Future
    replica.state, replica.load                      # what the router weighs
    await replica.stop()

Callbacks (on the event loop of the process holding the replica): on_step(replica, StepReport) for each step's
deltas, stats and block events; on_failure(replica, error) when its live requests are lost (failed for good, or
its host process died); on_state(replica) when it turns RECOVERING or back to SERVING.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shardserve.cluster.engine import EngineStats
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig


class ReplicaState(enum.Enum):
    STOPPED = "stopped"  # not started, or stopped
    STARTING = "starting"  # the group is being placed and loaded
    SERVING = "serving"
    RECOVERING = "recovering"  # its group (or host) failed; a new one is starting, live requests wait for it
    FAILED = "failed"  # loading failed, a step failed or a rank stopped answering health checks


@dataclass(slots=True)
class ReplicaLoad:
    """The load facts the router weighs (kept on the event loop; no call to the engine thread)."""

    num_live: int = 0  # admitted, not yet finished
    outstanding_tokens: int = 0  # the live requests' prompt tokens + max_tokens (an upper bound of its work)
    num_kv_blocks: int = 0
    num_free_blocks: int = 0  # after the last step

    def admitted(self, num_tokens: int) -> None:
        """A request of num_tokens (its cost: prompt + max new tokens) was routed here."""
        self.num_live += 1
        self.outstanding_tokens += num_tokens

    def finished(self, num_tokens: int) -> None:
        self.num_live -= 1
        self.outstanding_tokens -= num_tokens


@runtime_checkable
class Replica(Protocol):
    """One TP group's engine as the front and the controller see it."""

    id: str
    state: ReplicaState
    serving: bool  # state is SERVING (a plain attribute: the router reads it per request)
    recovering: bool  # state is RECOVERING
    error: BaseException | None
    load: ReplicaLoad
    num_restarts: int  # groups (and host processes) replaced after a failure
    step_s_total: float  # wall time of its engine steps so far

    @property
    def tokenizer(self) -> Any: ...

    async def start(self) -> None: ...

    async def stop(self, timeout_s: float = 30.0) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    async def admit(self, req_id: str, token_ids: list[int], params: SamplingParams, text: str | None = None,
                    resumed=()) -> None: ...

    def abort(self, req_id: str) -> Future: ...

    def submit(self, fn: Callable) -> Future: ...

    async def stats(self) -> EngineStats: ...

    async def executor_facts(self) -> dict: ...


class ReplicaBase:
    """What both implementations share: the constructor's settings and callbacks, the state and its flags."""

    def __init__(
        self,
        replica_id: str,
        engine_config: EngineConfig,
        build_engine: Callable,  # EngineConfig -> Engine, off the event loop (the group's factory)
        on_step: Callable[[Any, Any], None],
        on_failure: Callable[[Any, BaseException], None],
        health_check_interval_s: float = 5.0,
        restart_tries: int = 3,  # new groups tried after a failure (0: a failure fails the replica)
        restart_backoff_s: float = 1.0,
        on_state: Callable[[Any], None] = lambda replica: None,  # RECOVERING and back (on the event loop)
    ) -> None:
        self.id = replica_id
        self.engine_config = dataclasses.replace(engine_config, block_events=True)  # its steps report them
        self.state = ReplicaState.STOPPED
        self.error: BaseException | None = None
        self.load = ReplicaLoad()
        self._build = build_engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._on_state = on_state
        self._health_interval_s = health_check_interval_s
        self._restart_tries = restart_tries
        self._restart_backoff_s = restart_backoff_s
        self.num_restarts = 0
        self.step_s_total = 0.0

    @property
    def state(self) -> ReplicaState:
        return self._state

    @state.setter
    def state(self, value: ReplicaState) -> None:
        self._state = value
        self.serving = value is ReplicaState.SERVING  # plain attributes: the router reads them per request
        self.recovering = value is ReplicaState.RECOVERING

    def _note_step(self, report) -> None:
        """What every step report updates before it goes to on_step."""
        self.load.num_free_blocks = report.stats.num_kv_blocks - report.stats.num_kv_blocks_used
        self.step_s_total += report.step_s
