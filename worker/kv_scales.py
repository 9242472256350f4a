"""The FP8 KV cache's scales (one float32 per layer and KV head for K, and for V), set once at start-up.

Where they come from, in order:
1. The checkpoint, where it has them: tensors named `model.layers.N.self_attn.k_scale` / `.v_scale` (the names
   vLLM and llm-compressor write; per tensor, or one per KV head). They were measured on real data by whoever
   quantized the model, so they are kept as they are.
2. Otherwise calibration: one forward over a fixed pseudo-random prompt (CALIBRATION_TOKENS tokens, the same on
   every rank and every run) with a cache in the model's dtype, recording each layer's and KV head's largest |k| and
   |v|; scale = CALIBRATION_MARGIN x that / 448. Computed rather than fixed at 1.0 because K and V ranges differ by
   orders of magnitude between models, layers and heads (a K bias can put a head in the hundreds, past e4m3's 448),
   and computed once rather than from each batch so that a request's tokens never depend on what else ran before
   it. The margin leaves room for prompts that reach further than the calibration one; it costs nothing in
   precision for values within 448 / 2^15 of the largest, e4m3's normal range. Values beyond 448 x scale saturate.
   docs/performance-history.md has the measured effect on the default model's outputs.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from shardserve.kernels.kv_fp8 import scales_from_amax
from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, cdiv
from shardserve.worker.distributed import tp_rank, tp_size
from shardserve.worker.input_batch import InputBatch
from shardserve.worker.layers.attention import Attention

CALIBRATION_TOKENS = 512
CALIBRATION_MARGIN = 4.0
CHECKPOINT_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def load_checkpoint_scales(model: nn.Module, model_dir: str) -> int:
    """Copies the checkpoint's k_scale / v_scale tensors into the layers; returns how many layers got both."""
    layers = attention_layers(model)
    found: dict[tuple[int, str], torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(CHECKPOINT_SCALE_SUFFIXES) and key.startswith("model.layers."):
                    layer = int(key.split(".")[2])
                    found[(layer, key.rsplit(".", 1)[1])] = f.get_tensor(key).float().reshape(-1)
    complete = 0
    for i, attn in enumerate(layers):
        if (i, "k_scale") in found and (i, "v_scale") in found:
            for name in ("k_scale", "v_scale"):
                getattr(attn, name).copy_(_this_rank(found[(i, name)], attn.num_kv_heads))
            attn.scales_from_checkpoint = True
            complete += 1
    return complete


def _this_rank(scale: torch.Tensor, heads_per_rank: int) -> torch.Tensor:
    """A per-tensor scale for every head; per-head scales: this rank's heads (a replicated head keeps its own)."""
    if scale.numel() == 1:
        return scale.expand(heads_per_rank)
    total = scale.numel()
    if total == heads_per_rank:
        return scale
    tp, rank = tp_size(), tp_rank()
    if total % tp == 0 and total // tp == heads_per_rank:
        return scale[rank * heads_per_rank:(rank + 1) * heads_per_rank]
    if tp % total == 0 and heads_per_rank == 1:  # more ranks than KV heads: each rank holds one replicated head
        return scale[rank // (tp // total)].reshape(1)
    raise ValueError(f"a checkpoint KV scale of {total} values does not fit {heads_per_rank} KV heads per rank")


@torch.inference_mode()
def calibrate_scales(model: nn.Module, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Sets every layer's scales not taken from the checkpoint from one calibration forward (see the module doc)."""
    from shardserve.worker.kv_cache import allocate_kv_cache

    layers = [a for a in attention_layers(model) if not a.scales_from_checkpoint]
    if not layers:
        return
    tokens = torch.randint(0, model.vocab_size, (CALIBRATION_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(cdiv(len(tokens), block_size)))
    scratch = allocate_kv_cache(model, len(blocks), block_size, dtype, device)
    request = NewRequest("calibration", tokens, len(tokens), 0, blocks, SamplingSpec())
    plan = StepPlan(1, new_requests=[request], req_ids=["calibration"], num_tokens=[len(tokens)])
    input_ids, positions, meta = InputBatch(block_size).prepare(plan).to_device(device)
    for attn in layers:
        attn.observed_amax = torch.zeros(2, attn.num_kv_heads, dtype=torch.float32, device=device)
    try:
        model(input_ids, positions, scratch, meta)
        for attn in layers:
            attn.k_scale.copy_(scales_from_amax(attn.observed_amax[0], CALIBRATION_MARGIN))
            attn.v_scale.copy_(scales_from_amax(attn.observed_amax[1], CALIBRATION_MARGIN))
    finally:
        for attn in layers:
            attn.observed_amax = None
