"""What operators and benchmarks ask of a running cluster, apart from serving requests: each replica's worker group
and step times, and a reset of the prefix caches between A/B runs. ControllerViews reads the cluster through the
ServedReplicas interface (the controller implements it), never through its fields."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from shardserve.cluster.engine import EngineStats
from shardserve.cluster.replica import Replica, ReplicaState
from shardserve.cluster.router import POLICIES


class ServedReplicas(Protocol):
    """The replicas and what the fronts routing to them know."""

    replicas: Sequence[Replica]

    async def routed(self) -> list[int]:
        """Requests routed to each replica, over every front."""
        ...

    async def reset_routing(self, policy: str | None) -> None:
        """Every front forgets its prefix index and switches its policy (None: kept)."""
        ...


class ControllerViews:
    def __init__(self, source: ServedReplicas) -> None:
        self.source = source

    async def worker_groups(self) -> list:
        """Each replica's current worker group (the executor's `group`, where it has one; None otherwise): endpoints,
        actors, the group's secret. For operators and tests holding the Ray cluster, which can drive it anyway."""
        return [(await r.executor_facts())["group"] for r in self.source.replicas]

    async def replica_stats(self) -> list[dict]:
        """Per replica: id, state, requests routed to it, the nodes of its ranks (where the executor knows them),
        the wall time of its engine steps and its workers' own time in them (step_s, forward_s: the current
        group's, for the control-plane share), and (serving ones) its engine's prompt and cached-prompt
        token counts (the prefix-cache hit rate) and finished requests."""
        out = []
        routed = await self.source.routed()
        for i, r in enumerate(self.source.replicas):
            facts = await r.executor_facts()
            row = dict(id=r.id, state=r.state.value, routed=routed[i], nodes=facts["nodes"],
                       step_s=facts.get("step_s", r.step_s_total), forward_s=facts["forward_s"])
            if r.serving:
                s = await r.stats()
                row.update(prompt_tokens=s.num_prompt_tokens, cached_prompt_tokens=s.num_cached_prompt_tokens,
                           finished=s.num_finished, generated_tokens=s.num_generated_tokens)
            out.append(row)
        return out

    async def reset_caches(self, routing: str | None = None, kv_blocks: int | None = None) -> list[int]:
        """For A/B benchmarks on one running cluster, while no request is live: every serving replica forgets its
        prefix cache (the fronts their indexes), routing becomes the policy (None: unchanged) and each replica keeps
        kv_blocks usable KV blocks (Engine.reset_prefix_cache; None: all). Returns each one's usable blocks."""
        if routing is not None and routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {routing!r}")

        def reset(engine) -> int:
            return engine.reset_prefix_cache(kv_blocks)  # its events dropped: the fronts forget them below

        replicas = self.source.replicas
        usable = [await asyncio.wrap_future(r.submit(reset)) if r.serving else 0 for r in replicas]
        await self.source.reset_routing(routing)
        return usable


async def summed_stats(replicas: Sequence[Replica], routed: Sequence[int], serving: bool) -> tuple:
    """(fresh engine stats summed over the serving and recovering replicas, or None; per replica: id, state,
    requests routed, stats or None). Stats are taken between two steps."""
    each = [None] * len(replicas)
    stats = None
    if serving:
        up = [i for i, r in enumerate(replicas) if r.state in (ReplicaState.SERVING, ReplicaState.RECOVERING)]
        for i, s in zip(up, await asyncio.gather(*(replicas[i].stats() for i in up))):
            each[i] = s
        stats = _sum_stats([s for s in each if s is not None]) if up else None
    return stats, [dict(id=r.id, state=r.state.value, routed=routed[i], stats=each[i]) for i, r in enumerate(replicas)]


def _sum_field(values: list):
    """Numbers add up; tuples (per-position counts) add position by position."""
    if values and isinstance(values[0], tuple):
        width = max(len(v) for v in values)
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    return sum(values)


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    total = EngineStats(*(_sum_field([getattr(s, f) for s in stats]) for f in EngineStats.__slots__))
    total.kv_usage = total.num_kv_blocks_used / max(total.num_kv_blocks, 1)
    return total
