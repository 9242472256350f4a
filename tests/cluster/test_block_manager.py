from shardserve.cluster import block_manager as bm_module
from shardserve.cluster.block_manager import BlockManager
from shardserve.cluster.request import Request

BS = 4


def seq(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens))


def admit(bm: BlockManager, s: Request, num_tokens: int | None = None) -> int:
    """Allocates like the scheduler does; returns the cached prefix length."""
    hits = bm.find_cached_prefix(s)
    assert bm.allocate(s, hits, num_tokens if num_tokens is not None else len(s.token_ids))
    return len(hits) * BS


def computed(bm: BlockManager, s: Request) -> None:
    """The workers computed all of s's tokens: its full blocks become findable."""
    bm.register_full_blocks(s, len(s.token_ids))


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    a, b = seq("a", range(10)), seq("b", range(100, 105))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_ids) == 3 and len(b.block_ids) == 2
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5
    assert not set(a.block_ids) & set(b.block_ids)
    bm.free(a)
    bm.free(b)
    assert bm.all_free() and a.block_ids == [] and bm.usage == 0.0


def test_shared_prefix_blocks_are_reference_counted_not_copied():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(9)))  # two full blocks + 1 token
    admit(bm, a)
    computed(bm, a)
    b = seq("b", list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_count(x) for x in a.block_ids[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_ids[:2]] == [1, 1]
    bm.free(b)
    assert bm.all_free()


def test_hash_chain_misses_when_an_earlier_block_differs():
    bm = BlockManager(16, BS)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    computed(bm, a)
    # second block's tokens equal, first block differs: the chain hash must not match
    b = seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, b) == 0


def test_hit_compares_token_ids_not_only_the_hash(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(16, BS)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    computed(bm, a)
    assert bm.num_cached_blocks == 1
    assert admit(bm, seq("b", [9, 9, 9, 9, 5])) == 0
    assert admit(bm, seq("c", [1, 2, 3, 4, 7])) == 4


def test_hit_never_covers_the_whole_prompt():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(8)))
    admit(bm, a)
    computed(bm, a)
    assert bm.num_cached_blocks == 2
    b = seq("b", list(range(8)))  # identical, exactly two blocks: one token must still be computed
    assert admit(bm, b) == 4
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(11)))
    admit(bm, a)
    bm.register_full_blocks(a, 6)  # a chunk of 6 tokens ran: one full block
    assert bm.num_cached_blocks == 1
    assert admit(bm, seq("b", list(range(11)))) == 4
    bm.register_full_blocks(a, 11)
    assert bm.num_cached_blocks == 2


def test_freed_cached_blocks_are_revived_by_a_hit():
    bm = BlockManager(4, BS)
    a = seq("a", list(range(9)))
    admit(bm, a)
    computed(bm, a)
    bm.free(a)
    assert bm.all_free() and bm.num_cached_blocks == 2
    b = seq("b", list(range(9)))
    assert admit(bm, b) == 8
    assert bm.num_free_blocks == 1 and [bm.ref_count(x) for x in b.block_ids] == [1, 1, 1]


def test_eviction_takes_unhashed_blocks_first_then_least_recently_freed_chain_tail_first():
    bm = BlockManager(6, BS)
    a = seq("a", list(range(8)) + [99])  # blocks: a0 a1 (hashed) + partial
    admit(bm, a)
    computed(bm, a)
    b = seq("b", list(range(200, 208)) + [99])
    admit(bm, b)
    computed(bm, b)
    a0, a1, a_partial = a.block_ids
    b0, b1, b_partial = b.block_ids
    bm.free(a)  # freed first: least recently freed
    bm.free(b)
    taken = []
    for i in range(6):
        s = seq(f"x{i}", [1000 + i])
        admit(bm, s)
        taken.append(s.block_ids[0])
    assert set(taken[:2]) == {a_partial, b_partial}  # nothing reusable in them
    assert taken[2:] == [a1, a0, b1, b0]  # a before b; within a chain the tail goes before the head
    assert bm.num_cached_blocks == 0


def test_eviction_keeps_the_prefix_findable_longest():
    bm = BlockManager(4, BS)
    a = seq("a", list(range(12)) + [7])
    admit(bm, a)
    computed(bm, a)
    head = a.block_ids[:2]
    bm.free(a)
    admit(bm, seq("x", [500]))  # evicts the unhashed tail block
    admit(bm, seq("y", [501]))  # evicts a's third (last full) block
    hits = bm.find_cached_prefix(seq("b", list(range(12)) + [8]))
    assert hits == head  # the first two blocks are still there


def test_append_slots_allocates_only_at_block_boundaries():
    bm = BlockManager(8, BS)
    a = seq("a", [1, 2, 3])
    admit(bm, a)
    assert len(a.block_ids) == 1
    assert bm.append_slots(a, 4) == []
    new = bm.append_slots(a, 5)
    assert new is not None and len(new) == 1 and a.block_ids[-1] == new[0]
    assert bm.append_slots(a, 8) == []
    assert len(bm.append_slots(a, 13)) == 2


def test_failed_allocation_changes_nothing():
    bm = BlockManager(3, BS)
    a = seq("a", list(range(9)))
    admit(bm, a)
    b = seq("b", list(range(100, 105)))
    assert not bm.allocate(b, [], 5)
    assert b.block_ids == [] and bm.num_free_blocks == 0
    assert bm.append_slots(a, 13) is None and len(a.block_ids) == 3
    assert not bm.can_allocate(1)


def test_revived_blocks_count_against_free_space():
    bm = BlockManager(3, BS)
    a = seq("a", list(range(9)))
    admit(bm, a)
    computed(bm, a)
    bm.free(a)
    c = seq("c", [5])
    admit(bm, c)  # takes the unhashed block; a0, a1 remain free and cached
    b = seq("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits 2 blocks (both free) + needs 2 more: 4 > 2 free
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert not bm.allocate(b, hits, 13)
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq("a", list(range(9)))
    admit(bm, a)
    computed(bm, a)
    assert bm.num_cached_blocks == 0
    assert admit(bm, seq("b", list(range(9)))) == 0


def test_reset_prefix_cache_forgets_every_hash():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(9)))
    admit(bm, a)
    computed(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.all_free()
    assert admit(bm, seq("b", list(range(9)))) == 0


def test_events_report_stored_then_evicted_hashes_in_order_and_match_the_routers_hashes():
    from shardserve.cluster.router import prompt_block_hashes

    bm = BlockManager(3, BS, record_events=True)
    a = seq("a", list(range(9)))  # two full blocks + 1 token
    admit(bm, a)
    computed(bm, a)
    stored = bm.take_events()
    assert stored == [(h, True) for h in prompt_block_hashes(a.token_ids, BS)] and len(stored) == 2
    bm.free(a)
    b = seq("b", list(range(100, 112)))  # three fresh blocks: both cached blocks are evicted
    admit(bm, b)
    assert sorted(bm.take_events()) == sorted((h, False) for h, _ in stored)
    assert bm.take_events() == []


def test_limit_blocks_holds_the_rest_least_valuable_first_and_gives_them_back():
    bm = BlockManager(8, BS, record_events=True)
    a = seq("a", list(range(8)))  # two full blocks, cached once computed
    admit(bm, a)
    computed(bm, a)
    bm.free(a)
    assert bm.limit_blocks(4) == 4  # 6 free blocks hold nothing: 4 of those are held
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert len(bm.find_cached_prefix(seq("b", list(range(9))))) == 2
    assert bm.limit_blocks(1) == 1 and bm.num_cached_blocks == 1  # then cached ones, the tail first: the head stays
    assert (bm.take_events()[-1][1]) is False
    b = seq("b", list(range(100, 106)))
    assert not bm.allocate(b, [], 6)  # two blocks needed, one usable
    assert bm.limit_blocks(8) == 8 and bm.all_free()
    assert bm.allocate(b, [], 6)
