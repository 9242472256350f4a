"""build_model: the architecture named in config.json -> our model class, built on the device in the dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend
from shardserve.proto.stages import PipelineStage
from shardserve.worker.models import SUPPORTED_ARCHITECTURES
from shardserve.worker.models.decoder import DecoderForCausalLM
from shardserve.worker.models.llama import LlamaForCausalLM
from shardserve.worker.models.qwen2 import Qwen2ForCausalLM
from shardserve.worker.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # dense Mistral is the Llama network (no sliding window here)
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "worker/models/__init__.py names every class here"


def supported_architectures() -> list[str]:
    return sorted(SUPPORTED_ARCHITECTURES)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device, attn_backend: AttentionBackend,
                stage: PipelineStage | None = None) -> nn.Module:
    """Builds the model with uninitialised parameters (load_weights or init_dummy_weights fills them); with a
    pipeline stage, only what that stage holds (proto/stages.py)."""
    architectures = getattr(hf_config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    if arch not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        )
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the model dtype; rotary caches stay float32
    try:
        with torch.device(device):
            model = MODEL_CLASSES[arch](hf_config, attn_backend, stage)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.eval()
