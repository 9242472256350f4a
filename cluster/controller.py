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
import logging
import sys

from shardserve.cluster.controller_types import ControllerConfig, LiveRequest, ServedModel, State, StreamItem
from shardserve.cluster.controller_views import ControllerViews
from shardserve.cluster.front import Front, FrontSettings
from shardserve.cluster.local_replica import LocalReplica
from shardserve.cluster.remote_replica import RemoteReplica
from shardserve.cluster.replica import Replica

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
        self.front = Front(FrontSettings(
            engine=config.engine, model=config.model, num_replicas=config.num_replicas, host=config.host,
            port=config.port, routing=config.routing, max_live_requests=config.max_live_requests,
            stream_interval=config.stream_interval, security=config.security))
        self.metrics = self.front.metrics
        self.metrics_address: str | None = None
        front = self.front
        # With replica hosts, each replica's engine runs in a process of its own (cluster/remote_replica.py).
        make, extra = (LocalReplica, {}) if config.replica_hosts is None else (RemoteReplica, {"hosts": config.replica_hosts})
        self.replicas: list[Replica] = [
            make(f"{config.name}/{i}", config.engine, config.build_engine, front.on_step, front.on_replica_failure,
                 config.health_check_interval_s, config.restart_tries, config.restart_backoff_s,
                 front.on_replica_state, **extra)
            for i in range(config.num_replicas)
        ]
        front.attach(self.replicas)
        self.views = ControllerViews(self)
        self._load_task: asyncio.Task | None = None
        self._load_error: BaseException | None = None

    @property
    def state(self) -> State:
        return self.front.state

    @property
    def address(self) -> str | None:
        return self.front.address

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serves gRPC at once (health NOT_SERVING) and loads the replicas in the background; returns host:port."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        address = await self.front.start_server()
        if self.config.metrics_port is not None:
            bound = self.metrics.serve(self.config.host, self.config.metrics_port)
            self.metrics_address = f"{self.config.host}:{bound}"
        self._load_task = asyncio.create_task(self._load())
        return address

    async def _load(self) -> None:
        """Starts every replica at once; serving needs all of them (a replica that fails to load fails the start)."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            self._load_error = errors[0]
            if self.front.state is State.STARTING:
                self.front.state = State.FAILED
            return
        await self.front.ready(self.replicas[0].tokenizer)

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
        return await self.front.drain(grace_s)

    async def shutdown(self, grace_s: float = 30.0) -> int:
        """Drains, stops the replicas (their engine loops and workers), then the servers. Returns drain()'s count."""
        cut = await self.drain(grace_s)
        self.front.state = State.STOPPED
        await asyncio.gather(*(r.stop(30.0) for r in self.replicas))
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        await self.front.close(SERVER_STOP_GRACE_S)
        self.metrics.close()
        return cut

    def pid(self) -> int:
        import os

        return os.getpid()

    def status(self) -> dict:
        error = self.front.failure or self._load_error
        return {"state": self.state.value, "address": self.address, "metrics_address": self.metrics_address,
                "live_requests": self.front.num_live, "error": repr(error) if error else None,
                "replicas": {r.id: r.state.value for r in self.replicas},
                "routed": dict(zip((r.id for r in self.replicas), self.front.routed())),
                "group_restarts": sum(r.num_restarts for r in self.replicas)}

    # ---- requests: the front's (tests and benchmarks that hold the controller call these) ------------------
    async def add_request(self, *args, **kwargs) -> LiveRequest:
        return await self.front.add_request(*args, **kwargs)

    # ---- the ServedReplicas interface (cluster/controller_views.py) -----------------------------------------
    async def routed(self) -> list[int]:
        return self.front.routed()

    async def reset_routing(self, policy: str | None) -> None:
        self.front.reset_routing(policy)

    # ---- what operators and benchmarks ask (cluster/controller_views.py) -----------------------------------
    async def server_stats(self):
        return await self.front.server_stats()

    async def worker_groups(self) -> list:
        return await self.views.worker_groups()

    async def replica_stats(self) -> list[dict]:
        return await self.views.replica_stats()

    async def reset_caches(self, routing: str | None = None, kv_blocks: int | None = None) -> list[int]:
        return await self.views.reset_caches(routing, kv_blocks)
