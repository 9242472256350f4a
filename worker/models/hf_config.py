"""A model folder's config.json read without transformers: the fields the models (decoder.py, rotary.py) and the
controller's model facts (shardserve/settings/resolve.py) use, each as transformers' config class for the model type would
set it, defaults included where the file leaves a field out.

Why not AutoConfig: building transformers' Llama or Qwen config class imports its modelling helpers, whose chain
reaches torch.distributed.tensor and sympy: seconds of CPU in each worker process, a third to a half of a CPU
worker's start-up, for nothing else the workers need. tests/worker/test_hf_config.py holds DEFAULTS to transformers' classes
and every value read here to AutoConfig's, over the configs shardserve ships and tests with and those configs with
fields removed.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

# architecture -> the model_type whose defaults apply where config.json names none
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}

_BASE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, hidden_act="silu", rms_norm_eps=1e-6,
             tie_word_embeddings=False)
# transformers 5.x's defaults (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) for the fields read here. None
# for num_key_value_heads or head_dim: derived below as the class derives it. A field a class lacks is absent.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_BASE, vocab_size=32000, intermediate_size=11008, num_key_value_heads=None, head_dim=None,
                  max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "mistral": dict(_BASE, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8, head_dim=None,
                    max_position_embeddings=131072, sliding_window=4096),
    "qwen2": dict(_BASE, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                  max_position_embeddings=32768, sliding_window=None, use_sliding_window=False),
    "qwen3": dict(_BASE, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, attention_bias=False, sliding_window=None, use_sliding_window=False),
}


# sizes the models build from: a file giving one as anything but a positive integer is refused, naming it
INTEGER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")


def read_hf_config(model_dir: str) -> SimpleNamespace:
    """config.json's fields as attributes (getattr(cfg, name, default) as on a transformers config), with the model
    type's defaults filled in and num_key_value_heads, head_dim and sliding_window derived as transformers does."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{model_dir} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    for name in INTEGER_FIELDS:
        value = raw.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{path}: {name} must be a positive integer, got {value!r}")
    architecture = (raw.get("architectures") or [None])[0]
    model_type = raw.get("model_type") or MODEL_TYPES.get(architecture)
    values = dict(DEFAULTS.get(model_type) or DEFAULTS.get(MODEL_TYPES.get(architecture), {}))
    values.update(raw)
    values["model_type"] = model_type
    heads = values.get("num_attention_heads")  # absent only for an architecture without defaults here
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = heads
    if "head_dim" in values and values["head_dim"] is None and heads:
        values["head_dim"] = values["hidden_size"] // heads
    if "use_sliding_window" in values and not values["use_sliding_window"]:
        values["sliding_window"] = None  # Qwen2/Qwen3: a window in the file is off unless use_sliding_window says so
    return SimpleNamespace(**values)
