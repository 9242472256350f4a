"""Controller: the cluster's control plane. It starts the engine replicas (cluster/replica.py), knows their state,
restarts what fails, answers operators (status, per-replica stats, cache resets) and drains at shutdown.
`shardserve serve` runs it as a Ray actor (an asyncio actor: its methods run on the actor's event loop); tests may
also run it in their own event loop.

Two shapes:
- Replicas in host processes (ControllerConfig.replica_hosts; the default with two or more): the client API is
  served by front processes (ControllerConfig.fronts; cluster/front_fleet.py, cluster/front_process.py) that route
  and stream straight from the hosts. The controller holds each replica as a RemoteReplica subscribed to state
  changes only: it never handles a token, and its death breaks no stream (hosts and fronts outlive it; a new
  controller adopts them by name and reloads nothing).
- Replicas in this process (one replica, tests, `--replica-hosts controller`): the controller holds one Front
  (cluster/front.py) over LocalReplicas and serves the client API itself (as it does over RemoteReplicas when
  given hosts but no fronts: the A/B baseline of bench/stream_cost.py).

Lifecycle: STARTING (health NOT_SERVING while the replicas load) -> SERVING -> DRAINING (SIGTERM: no new requests,
in-flight ones may finish) -> STOPPED; a replica whose worker fails starts a new TP group (RECOVERING: its live
requests wait, their streams see a pause) and, when that fails restart_tries times, ends its live streams with
UNAVAILABLE and gets nothing new; FAILED once no replica is serving or recovering.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from shardserve.cluster.controller_types import (ControllerConfig, FrontSettings, LiveRequest, ServedModel, State,
                                                 StreamItem)
from shardserve.cluster.controller_views import ControllerViews
from shardserve.cluster.front import Front
from shardserve.cluster.front_fleet import FrontFleet
from shardserve.cluster.local_replica import LocalReplica
from shardserve.cluster.remote_replica import RemoteReplica
from shardserve.cluster.replica import Replica, ReplicaState

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


class Controller:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        settings = FrontSettings(
            engine=config.engine, model=config.model, num_replicas=config.num_replicas, host=config.host,
            port=config.port, routing=config.routing, max_live_requests=config.max_live_requests,
            stream_interval=config.stream_interval, security=config.security)
        ids = [f"{config.name}/{i}" for i in range(config.num_replicas)]
        self.metrics_address: str | None = None
        self.front: Front | None = None
        self.fleet: FrontFleet | None = None
        self._state = State.STARTING
        self._failure: BaseException | None = None
        if config.replica_hosts is None or config.fronts is None:  # this process serves the client API
            front = self.front = Front(settings)
            self.metrics = front.metrics
            args = (config.engine, config.build_engine, front.on_step, front.on_replica_failure,
                    config.health_check_interval_s, config.restart_tries, config.restart_backoff_s,
                    front.on_replica_state)
            make = (lambda rid: LocalReplica(rid, *args)) if config.replica_hosts is None else (  # noqa: E731
                lambda rid: RemoteReplica(rid, *args, hosts=config.replica_hosts, subscriber="controller",
                                          deltas=True))
        else:  # state changes only: the fronts subscribe to the tokens
            self.fleet = FrontFleet(config.fronts, settings, ids, config.replica_hosts, config.restart_tries,
                                    config.metrics_port)
            self.metrics = None
            make = lambda rid: RemoteReplica(  # noqa: E731
                rid, config.engine, config.build_engine, lambda r, report: None, self._on_replica_failure,
                config.health_check_interval_s, config.restart_tries, config.restart_backoff_s,
                hosts=config.replica_hosts, subscriber="control", deltas=False)
        self.replicas: list[Replica] = [make(rid) for rid in ids]
        if self.front is not None:
            self.front.attach(self.replicas)
        self.views = ControllerViews(self)
        self._load_task: asyncio.Task | None = None
        self._load_error: BaseException | None = None

    @property
    def state(self) -> State:
        return self.front.state if self.front is not None else self._state

    @property
    def address(self) -> str | None:
        return self.front.address if self.front is not None else self.fleet.address

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serves gRPC at once (health NOT_SERVING) and loads the replicas in the background; returns host:port."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        if self.front is not None:
            address = await self.front.start_server()
            if self.config.metrics_port is not None:
                bound = self.metrics.serve(self.config.host, self.config.metrics_port)
                self.metrics_address = f"{self.config.host}:{bound}"
        else:
            address = await self.fleet.start()
            self.metrics_address = self.fleet.metrics_address
        self._load_task = asyncio.create_task(self._load())
        return address

    async def _load(self) -> None:
        """Starts every replica at once; serving needs all of them (a replica that fails to load fails the start)."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            self._load_error = errors[0]
            if self.state is State.STARTING:
                self._set_state(State.FAILED)
            return
        if self.front is not None:
            await self.front.ready(self.replicas[0].tokenizer)
        elif await self.fleet.wait_ready(None) and self._state is State.STARTING:
            self._state = State.SERVING

    def _set_state(self, state: State) -> None:
        if self.front is not None:
            self.front.state = state
        else:
            self._state = state

    def _on_replica_failure(self, replica: Replica, error: BaseException) -> None:
        """(Host processes) a replica failed for good or lost its host; the fronts end their own streams."""
        self._failure = error
        alive = any(r.state in (ReplicaState.SERVING, ReplicaState.RECOVERING) for r in self.replicas)
        if not alive and self._state in (State.SERVING, State.DRAINING):
            self._state = State.FAILED

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
        if self.front is not None:
            return await self.front.drain(grace_s)
        if self._state in (State.STARTING, State.SERVING):
            self._state = State.DRAINING
        return await self.fleet.drain(grace_s)

    async def shutdown(self, grace_s: float = 30.0) -> int:
        """Drains, stops the fronts and the replicas (their engine loops and workers), then the server. Returns
        drain()'s count."""
        cut = await self.drain(grace_s)
        if self.fleet is not None:
            await self.fleet.shutdown(0.0)
        self._set_state(State.STOPPED)
        await asyncio.gather(*(r.stop(30.0) for r in self.replicas))
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.front is not None:
            await self.front.close(SERVER_STOP_GRACE_S)
            self.metrics.close()
        return cut

    def pid(self) -> int:
        import os

        return os.getpid()

    def status(self) -> dict:
        """State, address, live requests, each replica's state and routed requests, group restarts. With front
        processes, their counts as of their last answer (asked every FLEET_POLL_S)."""
        if self.front is not None:
            failure, live, routed = self.front.failure, self.front.num_live, self.front.routed()
        else:
            failure, live, routed = self._failure, self.fleet.num_live, self.fleet.num_routed
        error = failure or self._load_error
        return {"state": self.state.value, "address": self.address, "metrics_address": self.metrics_address,
                "live_requests": live, "error": repr(error) if error else None,
                "replicas": {r.id: r.state.value for r in self.replicas},
                "routed": dict(zip((r.id for r in self.replicas), routed)),
                "group_restarts": sum(r.num_restarts for r in self.replicas)}

    async def front_statuses(self) -> list[dict | None]:
        """(Host processes) each front's state, address, live requests, routed counts and pid (None: no answer)."""
        return await self.fleet.statuses() if self.fleet is not None else []

    # ---- requests: the front's (tests and benchmarks that hold an in-process controller call these) ---------
    async def add_request(self, *args, **kwargs) -> LiveRequest:
        return await self.front.add_request(*args, **kwargs)

    # ---- the ServedReplicas interface (cluster/controller_views.py) -----------------------------------------
    async def routed(self) -> list[int]:
        return self.front.routed() if self.front is not None else await self.fleet.routed()

    async def reset_routing(self, policy: str | None) -> None:
        if self.front is not None:
            self.front.reset_routing(policy)
        else:
            await self.fleet.reset_routing(policy)

    # ---- what operators and benchmarks ask (cluster/controller_views.py) -----------------------------------
    async def server_stats(self):
        return await self.front.server_stats()

    async def worker_groups(self) -> list:
        return await self.views.worker_groups()

    async def replica_stats(self) -> list[dict]:
        return await self.views.replica_stats()

    async def reset_caches(self, routing: str | None = None, kv_blocks: int | None = None) -> list[int]:
        return await self.views.reset_caches(routing, kv_blocks)
