"""FrontFleet: the controller's side of the front processes (cluster/front_process.py) when the replicas run in host
processes: it starts them (or adopts the ones an earlier controller started, by name), all on one port, and asks
them what the controller reports (live requests, requests routed per replica), resets their routing, drains and
stops them. It never touches a request: the fronts stream from the hosts themselves.

Admission limits with several fronts: each front admits at most its share of max_live_requests (the limit divided
by the number of fronts, rounded up) and answers RESOURCE_EXHAUSTED beyond it; the engines' own queues bound the
rest (a request that cannot fit a replica's cache is refused there, at admission).

`fronts` is the launcher's (shardserve/launch/front_actors.py: RayFronts): start(k, *FrontProcess args) -> handle,
find(k) -> a live handle or None, kill(handle), count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from shardserve.cluster.controller_types import FrontSettings

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
POLL_S = 0.5  # how often the fronts' counts (live requests, routed) are asked for the controller's status


class FrontFleet:
    def __init__(self, fronts, settings: FrontSettings, replica_ids: list[str], hosts, restart_tries: int,
                 metrics_port: int | None) -> None:
        self.fronts, self.settings, self.replica_ids = fronts, settings, replica_ids
        self.hosts, self.restart_tries, self.metrics_port = hosts, restart_tries, metrics_port
        share = -(-settings.max_live_requests // max(1, fronts.count))
        self.settings = dataclasses.replace(settings, max_live_requests=share)
        self.handles: list = []
        self.address: str | None = None
        self.metrics_address: str | None = None
        self.num_live = 0  # over every front, as of the last poll
        self.num_routed = [0] * len(replica_ids)
        self.num_restarts = 0  # fronts started again after they died
        self._poll: asyncio.Task | None = None

    async def start(self) -> str:
        """Every front serving (health NOT_SERVING until it has found the hosts); returns their address."""
        port = self.settings.port
        for k in range(self.fronts.count):
            handle = await asyncio.to_thread(self.fronts.find, k)
            if handle is not None:
                try:
                    status = await asyncio.wait_for(handle.status.remote(), CALL_TIMEOUT_S)
                    log.warning("adopting front %d (pid %d), serving on %s", k, status["pid"], status["address"])
                    self.handles.append(handle)
                    self.address = self.address or status["address"]
                    port = int(status["address"].rsplit(":", 1)[1])
                    continue
                except Exception:
                    await asyncio.to_thread(self.fronts.kill, handle)
            handle = await self._start_front(k, port)
            status = await handle.status.remote()
            if k == 0:
                self.metrics_address = status["metrics_address"]
            self.handles.append(handle)
            self.address = self.address or status["address"]
            port = int(status["address"].rsplit(":", 1)[1])
        self._poll = asyncio.create_task(self._poll_counts())
        return self.address

    async def _poll_counts(self) -> None:
        """Every POLL_S: the fronts' counts; a front that died is started again on the port (its streams resume
        through the others meanwhile: their clients reconnect to the same address)."""
        while True:
            answers = await asyncio.gather(*(asyncio.wait_for(h.status.remote(), CALL_TIMEOUT_S)
                                             for h in self.handles), return_exceptions=True)
            statuses = [a for a in answers if isinstance(a, dict)]
            self.num_live = sum(s["live_requests"] for s in statuses)
            self.num_routed = [sum(s["routed"][i] for s in statuses) for i in range(len(self.replica_ids))]
            for k, answer in enumerate(answers):
                if isinstance(answer, Exception) and not isinstance(answer, asyncio.TimeoutError):  # dead, not busy
                    log.error("front %d is gone (%s): starting it again", k, answer)
                    await asyncio.to_thread(self.fronts.kill, self.handles[k])
                    try:
                        self.handles[k] = await self._start_front(k, int(self.address.rsplit(":", 1)[1]))
                        self.num_restarts += 1
                    except Exception:
                        log.exception("starting front %d again failed", k)
            await asyncio.sleep(POLL_S)

    async def _start_front(self, k: int, port: int):
        settings = dataclasses.replace(self.settings, port=port)
        handle = await asyncio.to_thread(self.fronts.start, k, settings, self.replica_ids, self.hosts,
                                         self.restart_tries, self.metrics_port if k == 0 else None)
        await handle.start.remote()
        return handle

    async def wait_ready(self, timeout: float | None) -> bool:
        results = await asyncio.gather(*(h.wait_ready.remote(timeout) for h in self.handles))
        return all(results)

    async def _each(self, method: str, *args, timeout: float = CALL_TIMEOUT_S) -> list:
        """method(*args) on every front; a front that does not answer (dead) gives None."""
        async def one(handle):
            try:
                return await asyncio.wait_for(getattr(handle, method).remote(*args), timeout)
            except Exception:
                return None

        return list(await asyncio.gather(*(one(h) for h in self.handles)))

    async def statuses(self) -> list[dict | None]:
        return await self._each("status")

    async def routed(self) -> list[int]:
        total = [0] * len(self.replica_ids)
        for counts in await self._each("routed"):
            for i, n in enumerate(counts or ()):
                total[i] += n
        return total

    async def reset_routing(self, policy: str | None) -> None:
        await self._each("reset_routing", policy)

    async def drain(self, grace_s: float) -> int:
        return sum(n or 0 for n in await self._each("drain", grace_s, timeout=grace_s + 30))

    async def shutdown(self, grace_s: float) -> int:
        if self._poll is not None:
            self._poll.cancel()
        cut = sum(n or 0 for n in await self._each("shutdown", grace_s, timeout=grace_s + 60))
        for handle in self.handles:
            await asyncio.to_thread(self.fronts.kill, handle)
        self.handles = []
        return cut
