"""The n-gram proposer, the acceptance counters and the speculative settings' parsing (no model needed)."""

from __future__ import annotations

import json

import pytest

from shardserve.cluster.speculation import NgramIndex, SpecDecodeStats
from shardserve.proto.speculative import SpeculativeConfig, parse_speculative_config


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurred at the start, followed by 4, 5, 9; (2, 3) alone last led to 7
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [8]  # nothing ever followed an 8
    assert index.propose(tokens, 3) == []
    tokens += [5]  # (8, 5) unseen; (5,) was followed by 9 (the latest earlier 5)
    assert index.propose(tokens, 4) == [9, 2, 3, 7]
    assert index.propose(tokens, 2) == [9, 2]  # at most k


def test_ngram_index_grows_with_appended_tokens_only():
    tokens = list(range(20)) + [5, 6]
    index = NgramIndex(2, 2)
    assert index.propose(tokens, 2) == [7, 8]
    assert index.indexed == len(tokens)
    tokens += [7, 8, 30, 31]
    assert index.propose(tokens, 3) == []  # (30, 31) new
    tokens += [5, 6]
    assert index.propose(tokens, 3) == [7, 8, 30]  # the latest (5, 6) was followed by 7, 8, 30


def test_stats_count_drafts_acceptance_and_positions():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(3, 0)
    stats.observe(4, 4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 6)
    assert stats.accepted_per_pos == [2, 2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(6 / 11)
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 3)


def test_speculative_config_parses_dicts_and_json_and_refuses_what_is_wrong():
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert cfg == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    assert parse_speculative_config(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["prompt_lookup_min"] == 1
    for bad, says in [("{", "not valid JSON"), ("[1]", "JSON object"), ({"method": "medusa"}, "method"),
                      ({"num_speculative_tokens": 2}, "needs a method"), ({"method": "ngram", "k": 2}, "unknown"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                      ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "exceeds")]:
        with pytest.raises(ValueError, match=says):
            parse_speculative_config(bad)


def _stats(**spec):
    from shardserve.cluster.engine import EngineStats

    base = dict(num_waiting=0, num_running=1, num_kv_blocks=10, num_kv_blocks_used=2, num_kv_blocks_cached=0,
                kv_usage=0.2, num_steps=5, num_preemptions=0, num_prompt_tokens=8, num_cached_prompt_tokens=0,
                num_computed_tokens=20, num_generated_tokens=12, num_finished=0)
    return EngineStats(**base, **spec)


def test_replicas_stats_sum_the_speculation_counters_position_by_position():
    from shardserve.cluster.controller_views import _sum_stats as sum_stats

    total = sum_stats([_stats(spec_num_drafts=3, spec_num_draft_tokens=10, spec_num_accepted_tokens=4,
                              spec_accepted_per_pos=(2, 1, 1)),
                       _stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=4,
                              spec_accepted_per_pos=(1, 1, 1, 1))])
    assert (total.spec_num_drafts, total.spec_num_draft_tokens, total.spec_num_accepted_tokens) == (4, 14, 8)
    assert total.spec_accepted_per_pos == (3, 2, 2, 1)
    assert total.spec_acceptance_rate == pytest.approx(8 / 14) and total.spec_mean_acceptance_length == 3.0


def test_prometheus_has_vllms_spec_decode_counters_advanced_by_what_each_replica_adds():
    from shardserve.cluster.metrics import ControllerMetrics

    metrics = ControllerMetrics("m")
    metrics.observe_stats(_stats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=3,
                                 spec_accepted_per_pos=(2, 1)), replica="a")
    metrics.observe_stats(_stats(spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=9,
                                 spec_accepted_per_pos=(4, 3, 2)), replica="a")
    metrics.observe_stats(_stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=0), replica="b")
    text = metrics.render().decode()
    assert 'shardserve:spec_decode_num_drafts_total{model_name="m"} 6.0' in text
    assert 'shardserve:spec_decode_num_draft_tokens_total{model_name="m"} 24.0' in text
    assert 'shardserve:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'shardserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0' in text


def test_get_server_stats_reports_the_speculation_counters_and_their_rates():
    import asyncio

    from shardserve.cluster.generation_service import GenerationServicer
    from shardserve.proto import generation_pb2 as pb

    class Backend:  # only what GetServerStats asks
        async def server_stats(self):
            stats = _stats(spec_num_drafts=4, spec_num_draft_tokens=16, spec_num_accepted_tokens=12,
                           spec_accepted_per_pos=(4, 3, 3, 2))
            return stats, {"requests_aborted": 0, "requests_rejected": 0, "uptime_s": 1.0, "replicas": []}

    msg = asyncio.run(GenerationServicer(Backend()).GetServerStats(pb.ServerStatsRequest(), None))
    assert (msg.spec_decode_num_drafts, msg.spec_decode_num_draft_tokens, msg.spec_decode_num_accepted_tokens) == \
        (4, 16, 12)
    assert list(msg.spec_decode_num_accepted_tokens_per_pos) == [4, 3, 3, 2]
    assert msg.spec_decode_acceptance_rate == pytest.approx(0.75) and msg.spec_decode_mean_acceptance_length == 4.0
