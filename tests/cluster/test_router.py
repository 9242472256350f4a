"""The global scheduler's choices (cluster/router.py) over stand-in replicas: affinity to the replica holding the
longest prefix, the index following stored/evicted events, load and health limits, and each policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shardserve.cluster.replica import ReplicaLoad
from shardserve.cluster.router import OVERLOAD_SLACK_TOKENS, Router, prompt_block_hashes

BS = 16


@dataclass
class FakeReplica:
    id: str
    serving: bool = True
    recovering: bool = False
    load: ReplicaLoad = field(default_factory=lambda: ReplicaLoad(num_kv_blocks=100, num_free_blocks=100))


def replicas(n: int) -> list[FakeReplica]:
    return [FakeReplica(f"r{i}") for i in range(n)]


def hashes(tokens: list[int]) -> list[int]:
    return prompt_block_hashes(tokens, BS)


PREFIX = list(range(64))  # 4 full blocks


def test_the_replica_holding_the_longest_prefix_wins_over_a_shorter_match_and_lower_load():
    rs = replicas(3)
    router = Router(rs)
    h = hashes(PREFIX + [1])
    router.apply_events(1, [(x, True) for x in h[:2]])
    router.apply_events(2, [(x, True) for x in h])
    rs[2].load.outstanding_tokens = 500  # busier, but within the overload limit
    assert router.route(h) == (2, 4)


def test_evicted_blocks_leave_the_index_and_a_failed_replica_is_forgotten():
    rs = replicas(2)
    router = Router(rs)
    h = hashes(PREFIX + [1])
    router.apply_events(1, [(x, True) for x in h])
    router.apply_events(1, [(h[0], False)])
    rs[0].load.outstanding_tokens = 10
    assert router.route(h) == (1, 0)  # the chain's head is gone: no match; least loaded is 1
    router.apply_events(0, [(x, True) for x in h])
    router.forget(0)
    assert router.index_size() == len(h)  # only replica 1's optimistic marks remain


def test_routing_marks_the_prefix_so_a_burst_sharing_it_follows_the_first_request():
    rs = replicas(4)
    router = Router(rs)
    h = hashes(PREFIX + [1])
    first, _ = router.route(h)
    rs[first].load.outstanding_tokens += 100
    assert all(router.route(h)[0] == first for _ in range(10))


def test_unhealthy_and_far_overloaded_replicas_get_nothing_new():
    rs = replicas(3)
    router = Router(rs)
    h = hashes(PREFIX + [1])
    router.apply_events(0, [(x, True) for x in h])
    router.apply_events(1, [(x, True) for x in h])
    rs[0].serving = False
    rs[1].load.outstanding_tokens = 3 * OVERLOAD_SLACK_TOKENS  # far above replica 2's 0
    assert router.route(h)[0] == 2
    rs[1].serving = rs[2].serving = False
    with pytest.raises(LookupError):
        router.route(h)


def test_with_none_serving_the_least_loaded_recovering_replica_takes_the_request():
    rs = replicas(3)
    router = Router(rs, "round-robin")
    for r in rs:
        r.serving = False
    rs[0].recovering = rs[2].recovering = True
    rs[0].load.outstanding_tokens = 500
    assert router.route([]) == (2, 0) and router.num_routed == [0, 0, 1]
    rs[1].serving = True  # a serving replica comes first again
    assert router.route([]) == (1, 0)


def test_least_loaded_and_round_robin_ignore_the_cache():
    rs = replicas(3)
    h = hashes(PREFIX + [1])
    least = Router(rs, "least-loaded")
    least.apply_events(0, [(x, True) for x in h])
    rs[0].load.outstanding_tokens, rs[1].load.outstanding_tokens = 50, 20
    assert least.route(h) == (2, 0)
    rr = Router(rs, "round-robin")
    assert [rr.route(h)[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="routing must be one of"):
        Router(rs, "random")


def test_prompt_hashes_equal_the_block_managers_chain():
    from shardserve.cluster.block_manager import ROOT_HASH, hash_block

    tokens = [(i * 7919) % 151936 for i in range(100)]
    expected, parent = [], ROOT_HASH
    for i in range(99 // BS):  # one token short of the whole prompt, as find_cached_prefix
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert hashes(tokens) == expected and len(expected) == 6
    assert hashes(tokens[:BS]) == [] and hashes(tokens[: BS + 1]) == expected[:1]


def test_max_blocks_keeps_the_chains_head():
    tokens = list(range(100))
    assert hashes(tokens)[:2] == prompt_block_hashes(tokens, BS, max_blocks=2)
