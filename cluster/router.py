"""Router: the global scheduler. Picks the replica (cluster/replica.py) each new request runs on.

Policies (`--routing`):
- "cache-aware" (default): the replica holding the longest run of the prompt's leading blocks in its prefix cache,
  ties to the least loaded; least-loaded when no replica holds the prompt's first block.
- "least-loaded": the fewest outstanding tokens (the live requests' prompt + max_tokens), ties to more free blocks.
- "round-robin": each serving replica in turn (the A/B baseline).
Under every policy only SERVING replicas are candidates (when none serves, a RECOVERING one takes the request, the
least loaded: it queues there and runs once the replica's new group is up), and under cache-aware a replica far
more loaded than the least loaded one (more than OVERLOAD_FACTOR x its outstanding tokens + OVERLOAD_SLACK_TOKENS)
gets nothing new, whatever it caches: affinity must not pile every request sharing a system prompt onto one replica.

The prefix index maps a block's chain hash (cluster/block_manager.py: hash_block, the same chain the replicas'
block managers compute) to a bitmask of the replicas holding it. It is fed by the replicas' block events (stored,
evicted; each StepReport carries its step's) and, optimistically, by routing itself: a request's blocks are
marked on its replica when it is routed, so the next request with the same prefix follows it before the first
one's prefill has finished. A mark that never becomes a stored block only costs one miss. A prompt's longest
match is one dict lookup per block with the masks ANDed, so routing is O(blocks + replicas).

Everything here runs on the controller's event loop; nothing blocks.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from typing import Protocol

from xxhash import xxh3_64_intdigest

from shardserve.cluster.block_manager import ROOT_HASH
from shardserve.cluster.replica import ReplicaLoad

POLICIES = ("cache-aware", "least-loaded", "round-robin")
# Routing looks at a prompt's first ROUTE_BLOCKS blocks only (512 tokens at block size 16): prompts that share
# more than that rank as equal matches and go to the less loaded holder. Hashing is most of routing's cost.
ROUTE_BLOCKS = 32
OVERLOAD_FACTOR = 2.0
OVERLOAD_SLACK_TOKENS = 4096


class Routable(Protocol):
    id: str
    load: ReplicaLoad

    @property
    def serving(self) -> bool: ...

    @property
    def recovering(self) -> bool: ...


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chain hashes of the prompt's blocks a prefix lookup can use (as BlockManager.find_cached_prefix: every
    full block but one token short of the whole prompt), the first max_blocks of them at most. Equal to chaining
    block_manager.hash_block (a test checks it), with the prompt's bytes made once instead of once per block."""
    num_blocks = (len(token_ids) - 1) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks <= 0:
        return []
    data = array("q", token_ids[: num_blocks * block_size]).tobytes()
    step = 8 * block_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(data), step):
        parent = xxh3_64_intdigest(parent.to_bytes(8, "little") + data[start : start + step])
        hashes.append(parent)
    return hashes


class Router:
    def __init__(self, replicas: Sequence[Routable], policy: str = "cache-aware") -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.replicas = list(replicas)
        self.policy = policy
        self._index: dict[int, int] = {}  # chain hash -> bitmask of replica positions holding it
        self._turn = itertools.count()
        self.num_routed = [0] * len(self.replicas)
        self.num_affinity = 0  # routed to a replica holding at least the first block

    # ---- the index ------------------------------------------------------------------------------------------
    def apply_events(self, position: int, events: Sequence[tuple[int, bool]]) -> None:
        """A replica's block events, in order: (hash, True) stored, (hash, False) evicted."""
        bit = 1 << position
        index = self._index
        for h, stored in events:
            if stored:
                index[h] = index.get(h, 0) | bit
            else:
                mask = index.get(h, 0) & ~bit
                if mask:
                    index[h] = mask
                else:
                    index.pop(h, None)

    def forget(self, position: int) -> None:
        """A replica lost its cache (failed, restarted): drop it from every entry. O(index)."""
        self.apply_events(position, [(h, False) for h, mask in list(self._index.items()) if mask >> position & 1])

    def index_size(self) -> int:
        return len(self._index)

    # ---- routing ---------------------------------------------------------------------------------------------
    def route_prompt(self, token_ids: Sequence[int], block_size: int) -> tuple[int, int]:
        """route() for a prompt's token ids: hashes its first ROUTE_BLOCKS blocks where the policy reads them."""
        hashes = prompt_block_hashes(token_ids, block_size, ROUTE_BLOCKS) if self.policy == "cache-aware" else ()
        return self.route(hashes)

    def route(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """(position of the chosen replica, how many leading blocks it is known to hold). Raises LookupError when
        no replica is serving or recovering. Under cache-aware, marks the prompt's blocks as held by the chosen replica."""
        replicas = self.replicas
        candidates = [i for i, r in enumerate(replicas) if r.serving]
        if not candidates:
            recovering = [i for i, r in enumerate(replicas) if r.recovering]
            if not recovering:
                raise LookupError("no replica is serving")
            chosen = min(recovering, key=lambda i: replicas[i].load.outstanding_tokens)
            self.num_routed[chosen] += 1
            return chosen, 0
        matched = 0
        if self.policy == "round-robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif self.policy == "least-loaded":
            chosen = self._least_loaded(candidates)
        else:
            chosen, matched = self._cache_aware(candidates, block_hashes)
            bit, index = 1 << chosen, self._index
            for h in block_hashes[matched:]:
                index[h] = index.get(h, 0) | bit
        self.num_routed[chosen] += 1
        return chosen, matched

    def _least_loaded(self, candidates: list[int]) -> int:
        """The fewest outstanding tokens; ties to the most free blocks, then the lowest position."""
        replicas = self.replicas
        best, best_key = candidates[0], None
        for i in candidates:
            load = replicas[i].load
            key = (load.outstanding_tokens, -load.num_free_blocks)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _cache_aware(self, candidates: list[int], block_hashes: Sequence[int]) -> tuple[int, int]:
        replicas = self.replicas
        outstanding = [replicas[i].load.outstanding_tokens for i in candidates]
        limit = min(outstanding) * OVERLOAD_FACTOR + OVERLOAD_SLACK_TOKENS
        eligible = [i for i, out in zip(candidates, outstanding) if out <= limit]
        # The longest match: AND the masks block by block while any eligible replica still holds the chain.
        mask, depth, index = 0, 0, self._index
        for i in eligible:
            mask |= 1 << i
        for h in block_hashes:
            held = mask & index.get(h, 0)
            if not held:
                break
            mask, depth = held, depth + 1
        if depth == 0:
            return self._least_loaded(eligible), 0
        self.num_affinity += 1
        return self._least_loaded([i for i in eligible if mask >> i & 1]), depth
