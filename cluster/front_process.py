"""FrontProcess: one front (cluster/front.py) as a process of its own: `shardserve serve` runs one or more as Ray
actors (shardserve/launch/front_actors.py), all on the client API's port (SO_REUSEPORT: the kernel spreads the
connections over them). Each finds every replica's host process by name (cluster/host_sources.py: FoundHosts),
subscribes to the deltas of the requests it admits and routes with its own prefix index, fed by every host's block
events; the controller only starts, counts and stops fronts. A front that dies ends only its own streams (their
clients resume them through another front); the controller's death ends none.

    front = FrontProcess(settings, replica_ids, hosts, restart_tries, metrics_port)
    address = await front.start()    # serves at once (health NOT_SERVING), attaches to the hosts in the background
    await front.wait_ready(60)       # every host found and subscribed: SERVING
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

from shardserve.cluster.controller_types import FrontSettings, State
from shardserve.cluster.front import Front
from shardserve.cluster.host_sources import FoundHosts
from shardserve.cluster.remote_replica import RemoteReplica

GIL_SWITCH_INTERVAL_S = 0.0005  # as in the controller and the hosts
SERVER_STOP_GRACE_S = 10.0


class FrontProcess:
    def __init__(self, settings: FrontSettings, replica_ids: list[str], hosts, restart_tries: int = 3,
                 metrics_port: int | None = None) -> None:
        self.settings, self.replica_ids, self.hosts = settings, replica_ids, hosts
        self.restart_tries, self.metrics_port = restart_tries, metrics_port
        self.front: Front | None = None
        self.metrics_address: str | None = None
        self._attach: asyncio.Task | None = None

    async def start(self) -> str:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        front = self.front = Front(self.settings)
        subscriber = f"front-{uuid.uuid4().hex[:8]}"
        replicas = [RemoteReplica(rid, self.settings.engine, None, front.on_step, front.on_replica_failure, 5.0,
                                  self.restart_tries, 1.0, front.on_replica_state, subscriber=subscriber,
                                  deltas=True, source=FoundHosts(self.hosts))
                    for rid in self.replica_ids]
        front.attach(replicas)
        address = await front.start_server()
        if self.metrics_port is not None:
            bound = front.metrics.serve(self.settings.host, self.metrics_port)
            self.metrics_address = f"{self.settings.host}:{bound}"
        self._attach = asyncio.create_task(self._attach_all())
        return address

    async def _attach_all(self) -> None:
        await asyncio.gather(*(r.start() for r in self.front.replicas))
        await self.front.ready(self.front.replicas[0].tokenizer)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self._attach), timeout)
        except asyncio.TimeoutError:
            return False
        return self.front.state is State.SERVING

    async def drain(self, grace_s: float = 30.0) -> int:
        return await self.front.drain(grace_s)

    async def shutdown(self, grace_s: float = 30.0) -> int:
        cut = await self.front.drain(grace_s)
        if self._attach is not None and not self._attach.done():
            self._attach.cancel()
        await asyncio.gather(*(r.stop(5.0) for r in self.front.replicas))  # stops listening; the hosts stay
        await self.front.close(SERVER_STOP_GRACE_S)
        self.front.metrics.close()
        return cut

    def status(self) -> dict:
        f = self.front
        return {"state": f.state.value, "address": f.address, "metrics_address": self.metrics_address,
                "live_requests": f.num_live, "routed": f.routed(),
                "replicas": {r.id: r.state.value for r in f.replicas}, "pid": os.getpid()}

    def routed(self) -> list[int]:
        return self.front.routed()

    def reset_routing(self, policy: str | None) -> None:
        self.front.reset_routing(policy)

    def pid(self) -> int:
        return os.getpid()
