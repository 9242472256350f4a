"""From user-facing arguments (LLM kwargs or CLI flags) to one resolved EngineConfig, plus the model facts the
controller needs (eos ids, vocabulary size) without loading any weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shardserve.proto.config import EngineConfig

CPU_MAX_MODEL_LEN = 4096  # a default cap: the CPU cache is small; users can raise it


@dataclass
class ModelFacts:
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    max_position_embeddings: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def read_model_facts(model_dir: str) -> ModelFacts:
    config = _read_json(os.path.join(model_dir, "config.json"))
    if not config:
        raise ValueError(f"{model_dir} has no config.json")
    generation = _read_json(os.path.join(model_dir, "generation_config.json"))
    eos = _as_list(generation.get("eos_token_id", config.get("eos_token_id")))
    heads = config["num_attention_heads"]
    return ModelFacts(
        architecture=(config.get("architectures") or ["?"])[0],
        vocab_size=config["vocab_size"],
        eos_token_ids=eos,
        bos_token_id=config.get("bos_token_id"),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        intermediate_size=config.get("intermediate_size", 0),
    )


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    dtype = aliases.get(dtype, dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
    return dtype


def build_engine_config(
    model: str | None = None,
    tensor_parallel_size: int = 1,
    device: str = "auto",
    dtype: str = "auto",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    load_format: str = "auto",
    **rest,
) -> EngineConfig:
    from shardserve.models import resolve_model

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy; got {load_format!r}")
    resolved = resolve_model(model, load_format)
    facts = read_model_facts(resolved.model_dir)
    device = resolve_device(device)
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if facts.num_attention_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's {facts.num_attention_heads} attention heads"
        )
    kv = facts.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the {kv} KV heads or be a multiple of them (replication)"
        )
    if facts.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's intermediate size {facts.intermediate_size}"
        )
    if max_model_len is None:
        max_model_len = facts.max_position_embeddings
        if device == "cpu":
            max_model_len = min(max_model_len, CPU_MAX_MODEL_LEN)
    elif max_model_len > facts.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {facts.max_position_embeddings}"
        )
    return EngineConfig(
        model=resolved.model_dir,
        tokenizer=resolved.tokenizer_dir,
        tensor_parallel_size=tp,
        device=device,
        dtype=resolve_dtype(dtype, device),
        load_format=resolved.load_format,
        max_num_seqs=max_num_seqs or 256,
        max_num_batched_tokens=max_num_batched_tokens or (8192 if device == "cuda" else 2048),
        max_model_len=max_model_len,
        **rest,
    )


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer from its local folder (never the hub), or None for dummy configs."""
    if config.tokenizer is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)


def model_facts(config: EngineConfig, tokenizer=None) -> ModelFacts:
    facts = read_model_facts(config.model)
    if not facts.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        facts.eos_token_ids = [tokenizer.eos_token_id]
    return facts
