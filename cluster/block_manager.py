"""BlockManager: the paged KV cache's blocks, their reference counts, and the prefix cache over full blocks.

A block holds the KV of `block_size` consecutive positions of one or more requests (shared when their prefixes
are equal). Block ids are global: every TP rank holds its heads' share of every block.

Prefix caching: once a block is full of computed tokens it is registered under a chain hash,
xxh3_64(parent hash, the block's token ids). A later request whose blocks hash the same reuses the block instead of
recomputing it; a hit also compares the stored parent hash and token ids, so a hash collision never returns
wrong KV. Freed blocks keep their hash and stay findable until the block is handed out again.

Invariants:
- ref_count[b] == number of live block tables holding b; a block is in the free queue iff its ref_count is 0.
- The free queue is ordered by eviction priority: blocks without a hash first (they hold nothing reusable), then
  hashed blocks least recently freed first. A table is freed tail first, so a chain's head (the prefix shared
  by most requests) is evicted last.
- `_cached` maps a hash to exactly one block whose `_hash` is that hash; a hashed block is only ever full and
  never written again while it holds the hash.
- A prefix hit never covers every token of a request: at least one position is computed, so there are logits.
- When every request has finished or been aborted, every block is free (`all_free()`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from shardserve.cluster.request import Request
from shardserve.proto.plan import cdiv

ROOT_HASH = 0  # the parent hash of a chain's first block


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chain hash of one full block: depends on every token before it through `parent_hash`."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int] = [ROOT_HASH] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front = evict first
        # Prefix-cache events for the global router (cluster/router.py), None = not recorded: (chain hash, True)
        # when a hash becomes findable, (hash, False) when it is evicted or forgotten, in order. take_events().
        self.events: list[tuple[int, bool]] | None = [] if record_events else None
        self._held: list[int] = []  # blocks kept out of use by limit_blocks (ref_count 1, no table)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a prefix lookup can find (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not any(self._ref_count)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------------------
    def _extend_hashes(self, seq: Request, num_full_blocks: int) -> None:
        """Extends seq.block_hashes to its first `num_full_blocks` blocks (their tokens must be known)."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Request) -> list[int]:
        """Ids of the longest run of cached blocks equal to seq's leading blocks; no side effects.

        Stops one token short of the whole list: a request must compute at least one position.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        self._extend_hashes(seq, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block = self._cached.get(seq.block_hashes[i])
            parent = seq.block_hashes[i - 1] if i else ROOT_HASH
            if (
                block is None
                or self._parent[block] != parent
                or self._tokens[block] != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block)
        return hits

    def register_full_blocks(self, seq: Request, num_computed_tokens: int) -> None:
        """Offers seq's blocks that are now full of computed tokens to the prefix cache."""
        num_full = num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks or not self.enable_prefix_caching:
            return  # the common case each decode step: no block filled up
        num_full = min(num_full, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block, h = seq.block_ids[i], seq.block_hashes[i]
            # Already known (a hit, or the same content computed by another request): keep the first copy.
            if self._hash[block] is None and h not in self._cached:
                self._hash[block] = h
                self._parent[block] = seq.block_hashes[i - 1] if i else ROOT_HASH
                self._tokens[block] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[h] = block
                if self.events is not None:
                    self.events.append((h, True))
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (blocks in use keep their KV; they are just no longer findable)."""
        if self.events is not None:
            self.events += [(h, False) for h in self._cached]
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._tokens = [None] * self.num_blocks

    def limit_blocks(self, num_usable: int) -> int:
        """Makes at most num_usable blocks usable by holding the others (free ones, least valuable first; held
        blocks count as used, with ref_count 1); a larger num_usable gives held blocks back. For benchmarks that
        need a cache of a given size on a device with room for more. Returns the blocks now usable."""
        while self.num_blocks - len(self._held) > num_usable and self._free:
            self._held.append(self._take_free_block())
        while self._held and self.num_blocks - len(self._held) < num_usable:
            block = self._held.pop()
            self._ref_count[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)  # holds nothing: evicted first
        return self.num_blocks - len(self._held)

    def take_events(self) -> list[tuple[int, bool]]:
        """The prefix-cache events since the last call ([] when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # ---- allocation ----------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:  # evict: its KV is about to be overwritten
            if self._cached.get(h) == block:
                del self._cached[h]
                if self.events is not None:
                    self.events.append((h, False))
            self._hash[block] = None
            self._tokens[block] = None
        self._ref_count[block] = 1
        return block

    def allocate(self, seq: Request, cached_blocks: list[int], num_tokens: int) -> bool:
        """Gives a request without blocks a table covering `num_tokens` positions, starting with `cached_blocks`
        (from find_cached_prefix). Returns False, changing nothing, when too few blocks are free."""
        assert not seq.block_ids, f"{seq.req_id} already holds blocks"
        num_new = max(self.blocks_for(num_tokens) - len(cached_blocks), 0)
        num_revived = sum(1 for b in cached_blocks if self._ref_count[b] == 0)
        if num_new + num_revived > len(self._free):
            return False
        for b in cached_blocks:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1
        seq.block_ids = list(cached_blocks) + [self._take_free_block() for _ in range(num_new)]
        seq.num_registered_blocks = len(cached_blocks)
        return True

    def append_slots(self, seq: Request, num_tokens: int) -> list[int] | None:
        """Grows seq's table to cover `num_tokens` positions. Returns the appended block ids ([] when none were
        needed), or None, changing nothing, when too few blocks are free."""
        num_new = cdiv(num_tokens, self.block_size) - len(seq.block_ids)
        if num_new <= 0:
            return []
        if num_new > len(self._free):
            return None
        new = [self._take_free_block() for _ in range(num_new)]
        seq.block_ids.extend(new)
        return new

    def trim(self, seq: Request, num_tokens: int) -> None:
        """Releases seq's blocks past those `num_tokens` positions need (rejected speculative tokens' slots).
        The released blocks hold no registered content (only computed, kept tokens' full blocks are hashed)."""
        keep = cdiv(num_tokens, self.block_size)
        while len(seq.block_ids) > keep:
            b = seq.block_ids.pop()
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)

    def free(self, seq: Request) -> None:
        """Releases seq's table, tail first (see the eviction order in the module docstring)."""
        for b in reversed(seq.block_ids):
            self._ref_count[b] -= 1
            assert self._ref_count[b] >= 0, f"block {b} freed twice"
            if self._ref_count[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)
        seq.block_ids = []
        seq.num_registered_blocks = 0
