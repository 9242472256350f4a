"""What operators and benchmarks ask of a running controller, apart from serving requests: stats summed over the
replicas (GetServerStats), each replica's worker group and step times, and a reset of the prefix caches between
A/B runs. A mixin of cluster/controller.py's Controller, whose state (replicas, router, counters) it reads."""

from __future__ import annotations

import asyncio
import time

from shardserve.cluster.controller_types import State
from shardserve.cluster.engine import EngineStats
from shardserve.cluster.replica import ReplicaState
from shardserve.cluster.router import POLICIES


class ControllerViews:
    async def server_stats(self) -> tuple[EngineStats | None, dict]:
        """Fresh engine stats (taken between two steps), summed over the serving replicas, and the controller's
        own counters, with each replica's id, state, routed requests and stats (None when not serving)."""
        stats, each = None, [None] * len(self.replicas)
        if self.state in (State.SERVING, State.DRAINING):
            serving = [i for i, r in enumerate(self.replicas)
                       if r.state in (ReplicaState.SERVING, ReplicaState.RECOVERING)]
            for i, s in zip(serving, await asyncio.gather(*(self.replicas[i].stats() for i in serving))):
                each[i] = s
            stats = _sum_stats([s for s in each if s is not None]) if serving else None
        replicas = [dict(id=r.id, state=r.state.value, routed=self.router.num_routed[i], stats=each[i])
                    for i, r in enumerate(self.replicas)]
        return stats, {"requests_aborted": self.num_aborted, "requests_rejected": self.num_rejected,
                       "uptime_s": time.time() - self._started_at, "replicas": replicas}

    async def worker_groups(self) -> list:
        """Each replica's current worker group (the executor's `group`, where it has one; None otherwise): endpoints,
        actors, the group's secret. For operators and tests holding the Ray cluster, which can drive it anyway."""
        return [(await r.executor_facts())["group"] for r in self.replicas]

    async def replica_stats(self) -> list[dict]:
        """Per replica: id, state, requests routed to it, the nodes of its ranks (where the executor knows them),
        the wall time of its engine steps and its workers' own time in them (step_s, forward_s: the current
        group's, for the control-plane share), and (serving ones) its engine's prompt and cached-prompt
        token counts (the prefix-cache hit rate) and finished requests."""
        out = []
        for i, r in enumerate(self.replicas):
            facts = await r.executor_facts()
            row = dict(id=r.id, state=r.state.value, routed=self.router.num_routed[i], nodes=facts["nodes"],
                       step_s=r.step_s_total, forward_s=facts["forward_s"])
            if r.serving:
                s = await r.stats()
                row.update(prompt_tokens=s.num_prompt_tokens, cached_prompt_tokens=s.num_cached_prompt_tokens,
                           finished=s.num_finished, generated_tokens=s.num_generated_tokens)
            out.append(row)
        return out

    async def reset_caches(self, routing: str | None = None, kv_blocks: int | None = None) -> list[int]:
        """For A/B benchmarks on one running cluster, while no request is live: every serving replica forgets its
        prefix cache (the router its index), routing becomes the policy (None: unchanged) and each replica keeps
        kv_blocks usable KV blocks (BlockManager.limit_blocks; None: all). Returns each one's usable blocks."""
        if routing is not None and routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {routing!r}")

        def reset(engine) -> int:
            bm = engine.block_manager
            bm.reset_prefix_cache()
            usable = bm.limit_blocks(bm.num_blocks if kv_blocks is None else kv_blocks)
            bm.take_events()  # forgotten here already: the router drops the replica's entries below
            return usable

        usable = [await asyncio.wrap_future(r.submit(reset)) if r.serving else 0 for r in self.replicas]
        for i in range(len(self.replicas)):
            self.router.forget(i)
        if routing is not None:
            self.router.policy = routing
        return usable


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    total = EngineStats(*(sum(getattr(s, f) for s in stats) for f in EngineStats.__slots__))
    total.kv_usage = total.num_kv_blocks_used / max(total.num_kv_blocks, 1)
    return total
