"""Where a RemoteReplica (cluster/remote_replica.py) gets its host process from.

- OwnedHosts (the controller): starts the host (or adopts the one already running under the replica's name: a
  restarted controller never reloads weights that are loaded), replaces it when it dies (restart_tries tries with
  backoff, as for a lost TP group) and ends it at stop.
- FoundHosts (a front process): finds the host the controller started, by the replica's name, and after a host's
  death waits for the controller's replacement; it never starts or ends one.

Both return (handle, info) where info is ReplicaHost.info() (cache size, tokenizer, state, group restarts).
`hosts` is the launcher's (shardserve/launch/replica_actors.py: RayReplicaHosts): start(replica_id, config,
build_engine, health_s, tries, backoff_s) -> handle, find(replica_id) -> a live handle or None, same(a, b),
kill(handle).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

FIND_POLL_S = 0.25


class HostGone(Exception):
    """No host could be started or found for the replica."""


async def _info_of(handle) -> dict | None:
    try:
        return await handle.info.remote()
    except Exception:
        return None


class OwnedHosts:
    owns = True

    def __init__(self, hosts, engine_config, build_engine, settings: tuple[float, int, float]) -> None:
        self.hosts, self.config, self.build, self.settings = hosts, engine_config, build_engine, settings
        self.num_replaced = 0

    async def first(self, replica_id: str):
        """The running host under this name when there is one that has loaded (adopted), else a new one."""
        found = await asyncio.to_thread(self.hosts.find, replica_id)
        if found is not None:
            info = await _info_of(found)
            if info is not None and info["state"] in ("serving", "recovering"):
                log.warning("replica %s: adopting its running host process", replica_id)
                return found, info
            await asyncio.to_thread(self.hosts.kill, found, replica_id)
        return await self._start(replica_id)

    async def _start(self, replica_id: str):
        host = None
        try:
            host = await asyncio.to_thread(self.hosts.start, replica_id, self.config, self.build, *self.settings)
            return host, await host.start.remote()
        except BaseException:
            if host is not None:
                await asyncio.to_thread(self.hosts.kill, host, replica_id)
            raise

    async def replace(self, replica_id: str, lost, still_wanted) -> tuple:
        """A new host after `lost` died: tries with backoff while still_wanted(); raises HostGone when all fail."""
        _, tries, wait_s = self.settings
        await asyncio.to_thread(self.hosts.kill, lost, replica_id)  # its placement group too: the new host needs the room
        error: BaseException | None = None
        for attempt in range(1, tries + 1):
            if not still_wanted():
                raise HostGone("stopped")
            try:
                handle, info = await self._start(replica_id)
            except Exception as e:
                log.exception("replica %s: starting a new host, try %d of %d, failed", replica_id, attempt, tries)
                error = e
                if attempt < tries:
                    await asyncio.sleep(wait_s)
                    wait_s = min(2 * wait_s, 15.0)
                continue
            self.num_replaced += 1
            return handle, info
        raise HostGone(f"the host process of replica {replica_id} could not be restarted in {tries} tries: {error}")

    async def release(self, handle, timeout_s: float, replica_id: str | None = None) -> None:
        try:
            await asyncio.wait_for(handle.stop.remote(timeout_s), timeout_s + 10)
        except (Exception, asyncio.TimeoutError):
            log.warning("a replica host did not stop cleanly; ending it")
        await asyncio.to_thread(self.hosts.kill, handle, replica_id)


class FoundHosts:
    owns = False

    def __init__(self, hosts, wait_s: float = 600.0) -> None:
        self.hosts, self.wait_s = hosts, wait_s
        self.num_replaced = 0

    async def _find(self, replica_id: str, unlike=None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while loop.time() < deadline:
            handle = await asyncio.to_thread(self.hosts.find, replica_id)
            if handle is not None and (unlike is None or not self.hosts.same(handle, unlike)):
                info = await _info_of(handle)
                if info is not None and info["state"] in ("serving", "recovering"):
                    return handle, info
            await asyncio.sleep(FIND_POLL_S)
        raise HostGone(f"no host process serves replica {replica_id} (waited {self.wait_s:g} s)")

    async def first(self, replica_id: str):
        return await self._find(replica_id)

    async def replace(self, replica_id: str, lost, still_wanted) -> tuple:
        handle, info = await self._find(replica_id, unlike=lost)
        self.num_replaced += 1
        return handle, info

    async def release(self, handle, timeout_s: float, replica_id: str | None = None) -> None:
        pass
