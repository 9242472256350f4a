"""Weights into a built model: from a folder of HF safetensors (each rank reads only its slices), or random.

HF names map onto our fused parameters: q_proj/k_proj/v_proj -> qkv_proj (shards "q", "k", "v") and
gate_proj/up_proj -> gate_up_proj (shards 0, 1). Every parameter carries a weight_loader that takes the
rank's slice from a lazy safetensors slice, so nothing outside the slice is read from disk.
"""

from __future__ import annotations

import glob
import os
import zlib
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

# (HF name fragment, our fragment, shard id)
_FUSED_NAMES: list[tuple[str, str, Any]] = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


def map_checkpoint_name(name: str) -> tuple[str, Any]:
    """HF checkpoint name -> (our parameter name, shard id or None)."""
    for hf_part, our_part, shard_id in _FUSED_NAMES:
        if hf_part in name:
            return name.replace(hf_part, our_part), shard_id
    return name, None


def _skipped(name: str, model: nn.Module) -> bool:
    holds = getattr(model, "holds_checkpoint_tensor", None)
    if holds is not None and not holds(name):
        return True  # another pipeline stage's
    if "rotary_emb.inv_freq" in name or name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
        return True  # (the KV scales: read by worker/kv_scales.py for an FP8 cache)
    # a tied checkpoint may still store lm_head.weight: the embedding already supplies it
    return name.startswith("lm_head.") and bool(getattr(model, "tie_word_embeddings", False))


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Loads every *.safetensors file in model_dir; raises if a checkpoint tensor has no home or a parameter stays unloaded."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    pending = {(name, shard) for name, p in params.items() for shard in p.global_shards}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if _skipped(key, model):
                    continue
                name, shard_id = map_checkpoint_name(key)
                if name not in params:
                    raise KeyError(f"checkpoint tensor {key!r} ({os.path.basename(path)}) has no parameter in the model")
                param = params[name]
                param.weight_loader(param, f.get_slice(key), shard_id)
                pending.discard((name, shard_id))
    if pending:
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in pending)
        raise KeyError(f"weights missing from {model_dir}: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights (normal, std 0.02; norm weights 1), the same global tensor on every rank.

    Each (parameter, shard) gets its own generator seeded from its name, generates the full unsharded
    tensor on the parameter's device and hands it to the weight_loader, which keeps this rank's slice.
    """
    for name, param in model.named_parameters():
        for shard_id, shape in param.global_shards.items():
            if name.endswith("norm.weight"):
                full = torch.ones(shape, dtype=param.dtype, device=param.device)
            else:
                tag = f"{name}:{shard_id}".encode()
                generator = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(tag))
                full = torch.randn(shape, generator=generator, dtype=torch.float32, device=param.device)
                full = full.mul_(0.02).to(param.dtype)
            param.weight_loader(param, full, shard_id)
            del full
