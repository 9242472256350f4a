"""Pipeline stages: which ranks form a stage, which decoder layers it holds, which rank reports a step's result.

A replica (one engine's workers) is pipeline_parallel_size x tensor_parallel_size ranks. Global rank r is TP rank
r % tp of stage r // tp: the ranks of a stage are consecutive, so they fill one node first (one placement bundle
range, local GPUs in order). The decoder layers split across the stages in order: stage 0 also holds the token
embedding, the last stage the final norm, the LM head and the sampler, so only the last stage's ranks sample, and
its first rank reports the step's tokens (StepResult); every other rank acknowledges the step id.

Both sides read it: the workers build their stage from it, the controller's executor knows whose answer carries
the tokens, and the placement report (shardserve/launch/stage_report.py) prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.proto.config import EngineConfig, parse_layer_partition


@dataclass(frozen=True, slots=True)
class PipelineStage:
    index: int  # 0 .. count - 1
    count: int  # pipeline_parallel_size
    first_layer: int  # the decoder layers [first_layer, end_layer) live on this stage
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


def world_size(config: EngineConfig) -> int:
    """Ranks of one replica: pipeline stages x tensor-parallel ranks."""
    return config.pipeline_parallel_size * config.tensor_parallel_size


def result_rank(config: EngineConfig) -> int:
    """The rank whose StepResult carries the sampled tokens: the first rank of the last stage."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def layer_counts(num_layers: int, stages: int, partition: str | None = None) -> list[int]:
    """Decoder layers per stage: the partition where given (it must add up to num_layers), else as even as can
    be, the earlier stages taking one fewer where it does not divide (the last stage also runs the LM head)."""
    if partition is not None:
        counts = parse_layer_partition(partition, stages)
        if sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {partition!r} holds {sum(counts)} layers; the model has {num_layers}")
        return counts
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {num_layers} decoder layers")
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i >= stages - extra else 0) for i in range(stages)]


def stage_of(config: EngineConfig, rank: int, num_layers: int) -> PipelineStage:
    """The pipeline stage global rank `rank` belongs to, with its layers."""
    pp = config.pipeline_parallel_size
    counts = layer_counts(num_layers, pp, config.pp_layer_partition)
    index = rank // config.tensor_parallel_size
    first = sum(counts[:index])
    return PipelineStage(index, pp, first, first + counts[index])
