"""The placement report of `shardserve serve --dry-run`: what each pipeline stage of a replica would hold on each of
its GPUs, from the model's config.json alone (nothing is loaded, no Ray is started), so that a plan can be checked
before the GPUs are booked.

Per stage: its ranks, its decoder layers (proto/stages.py's split), the weight bytes on each GPU (a TP rank's
slices as worker/layers shards them: query heads / tp, KV heads / tp or one replicated head, the MLP / tp, the
vocabulary / tp for the embedding on the first stage and the LM head on the last, norms whole), the KV cache bytes
one token takes on each GPU (its layers only), and what the KV cache could have of a GPU of the named size at
--gpu-memory-utilization after the weights (before activations and CUDA graphs, which a real start measures). The
replica's cache holds the same block ids on every stage, so its token capacity is the smallest stage's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import layer_counts

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_GIB = 1 << 30


@dataclass(frozen=True)
class StageFigures:
    index: int
    ranks: range
    first_layer: int
    end_layer: int
    weight_bytes: int  # on each GPU of the stage
    kv_bytes_per_token: int  # on each GPU of the stage
    kv_budget_bytes: int  # what the cache could have of one GPU (may be <= 0: the weights do not fit)

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_budget_bytes) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0


def stage_figures(config: EngineConfig, hf: object, gpu_memory_gb: float) -> list[StageFigures]:
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    hidden, heads, kv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hidden // heads
    weight = 1 if config.quantization == "fp8" else _BYTES[config.dtype]  # the linear layers'
    dtype = _BYTES[config.dtype]  # embedding, LM head, norms
    kv_heads = max(1, kv // tp)
    qkv = hidden * (heads // tp + 2 * kv_heads) * head_dim
    mlp = 3 * hidden * hf.intermediate_size // tp
    layer = (qkv + heads // tp * head_dim * hidden + mlp) * weight + 2 * hidden * dtype
    if getattr(hf, "model_type", "") == "qwen3":  # q/k norms
        layer += 2 * head_dim * dtype
    vocab_rows = -(-hf.vocab_size // tp)
    kv_element = _BYTES["fp8" if config.kv_cache_dtype == "fp8" else config.dtype]
    budget = int(gpu_memory_gb * _GIB * config.gpu_memory_utilization)
    out, first = [], 0
    for index, count in enumerate(layer_counts(hf.num_hidden_layers, pp, config.pp_layer_partition)):
        nbytes = count * layer
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        if index == 0:
            nbytes += vocab_rows * hidden * dtype
        if index == pp - 1:
            nbytes += hidden * dtype  # the final norm
            if not (tied and index == 0):  # a tied LM head shares the embedding's weight
                nbytes += vocab_rows * hidden * dtype
        out.append(StageFigures(index, range(index * tp, (index + 1) * tp), first, first + count, nbytes,
                                2 * count * kv_heads * head_dim * kv_element, budget - nbytes))
        first += count
    return out


def placement_report(config: EngineConfig, gpu_memory_gb: float, name: str | None = None) -> str:
    """The report as lines of text (what `serve --dry-run` prints)."""
    from shardserve.worker.models.hf_config import read_hf_config

    hf = read_hf_config(config.model)
    stages = stage_figures(config, hf, gpu_memory_gb)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    lines = [f"placement of one replica of {name or config.model}: {pp} pipeline stage(s) x {tp} tensor-parallel "
             f"rank(s) = {pp * tp} GPUs; {'FP8' if config.quantization == 'fp8' else config.dtype} weights, "
             f"{config.kv_cache_dtype} KV cache; GPUs of {gpu_memory_gb:g} GiB at gpu_memory_utilization "
             f"{config.gpu_memory_utilization:g}",
             "  each stage's ranks on one node (STRICT_PACK per stage); the activations cross between stages"]
    for s in stages:
        parts = ["embedding"] if s.index == 0 else []
        parts.append(f"layers {s.first_layer}-{s.end_layer - 1} ({s.end_layer - s.first_layer})")
        if s.index == pp - 1:
            parts.append("norm, LM head, sampling")
        verdict = (f"KV cache {s.kv_budget_bytes / _GIB:.1f} GiB = {s.kv_tokens:,} tokens" if s.kv_budget_bytes > 0
                   else f"does NOT fit: the weights exceed the usable {gpu_memory_gb * config.gpu_memory_utilization:g} GiB")
        lines.append(f"  stage {s.index} (ranks {s.ranks.start}-{s.ranks.stop - 1}): {', '.join(parts)}; per GPU: "
                     f"weights {s.weight_bytes / _GIB:.2f} GiB, KV {s.kv_bytes_per_token / 1024:.1f} KiB a token, "
                     f"{verdict}")
    if all(s.kv_budget_bytes > 0 for s in stages):
        tokens = min(s.kv_tokens for s in stages)
        lines.append(f"  the replica's KV cache: {tokens:,} tokens (the smallest stage's; one block table serves "
                     f"every stage), {tokens // config.max_model_len:,} sequences of max_model_len "
                     f"{config.max_model_len:,}; before activations and CUDA graphs, which a real start measures")
    else:
        lines.append("  does not fit: more stages (-pp), more ranks a stage (-tp), FP8 weights (--quantization fp8) "
                     "or GPUs with more memory")
    return "\n".join(lines)


def stage_nodes(groups: list, tp: int) -> str:
    """Where each replica's pipeline stages run, for the ready line: "replica 0: stage 0 on 10.0.0.5, stage 1 on
    10.0.0.6; ..." from each replica's WorkerGroup (its ranks' node addresses, stage-major); "?" where unknown."""
    parts = []
    for i, group in enumerate(groups):
        ips = list(getattr(group, "node_ips", None) or [])
        stages = [", ".join(sorted(set(ips[k : k + tp]))) for k in range(0, len(ips), tp)] or ["?"]
        parts.append(f"replica {i}: " + ", ".join(f"stage {s} on {where}" for s, where in enumerate(stages)))
    return "; ".join(parts)
