"""Pipeline stages (proto/stages.py): the layer split, who reports, and the refusals of a bad split."""

from __future__ import annotations

import pytest

from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import layer_counts, result_rank, stage_of, world_size
from shardserve.settings.resolve import build_engine_config


def test_layers_split_evenly_with_the_remainder_on_the_later_stages():
    assert layer_counts(30, 2) == [15, 15]
    assert layer_counts(30, 4) == [7, 7, 8, 8]
    assert layer_counts(4, 3) == [1, 1, 2]
    assert layer_counts(126, 2, "60,66") == [60, 66]


def test_stages_of_ranks_hold_consecutive_layers_and_the_last_stage_first_rank_reports():
    config = EngineConfig(model="m", tensor_parallel_size=2, pipeline_parallel_size=3)
    assert world_size(config) == 6 and result_rank(config) == 4
    stages = [stage_of(config, rank, 10) for rank in range(6)]
    assert [(s.index, s.first_layer, s.end_layer) for s in stages] == [
        (0, 0, 3), (0, 0, 3), (1, 3, 6), (1, 3, 6), (2, 6, 10), (2, 6, 10)]
    assert stages[0].is_first and not stages[0].is_last and stages[5].is_last


@pytest.mark.parametrize("pp, partition, message", [
    (3, "1,2", "needs 3 positive layer counts"),
    (2, "2,0", "needs 2 positive layer counts"),
    (2, "a,b", "comma-separated layer counts"),
])
def test_a_bad_partition_is_refused_when_the_config_is_made(pp, partition, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", pipeline_parallel_size=pp, pp_layer_partition=partition)


def test_a_split_the_model_cannot_take_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match="holds 30 layers; the model has 28"):
        build_engine_config(model="qwen3-0.6b", device="cpu", pipeline_parallel_size=2, pp_layer_partition="15,15")
    with pytest.raises(ValueError, match="exceeds the model's 28 decoder layers"):
        build_engine_config(model="qwen3-0.6b", device="cpu", pipeline_parallel_size=29)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        build_engine_config(model="qwen3-0.6b", device="cpu", pipeline_parallel_size=0)
