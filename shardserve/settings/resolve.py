"""From user settings (LLM keywords or CLI flags) to one resolved EngineConfig, plus the model facts the controller
needs (eos ids, vocabulary size) without loading any weights.

The settings are EngineConfig's user fields (proto/config.py): their names, defaults and allowed values are read
from there, so LLM, the CLI and this file never list them. build_engine_config is the one place where user-level
values are resolved: "auto" device and dtype, the model name -> local folders, max_model_len and the batch limits
left unset.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shardserve.settings.model_source import resolve_model
from shardserve.proto.speculative import parse_speculative_config
from shardserve.proto.stages import layer_counts
from shardserve.proto.config import EngineConfig, user_default, user_settings
from shardserve.worker.models import SUPPORTED_ARCHITECTURES
from shardserve.worker.models.hf_config import read_hf_config

# vLLM's trust_remote_code (LLM keyword, --trust-remote-code): accepted with this warning
TRUST_REMOTE_CODE_NOTE = ("trust_remote_code: accepted and ignored: shardserve runs its own implementation of each "
                          "supported architecture and never runs code that comes with a model")
CPU_MAX_MODEL_LEN = 4096  # a default cap: the CPU cache is small; users can raise it
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


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
    sliding_window: int | None = None  # tokens a layer attends back over, where the model limits it
    num_hidden_layers: int = 0  # decoder layers (split across pipeline stages)


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
    """The facts from config.json, with the defaults the workers' models get too (worker/models/hf_config.py)."""
    config = read_hf_config(model_dir)
    generation = _read_json(os.path.join(model_dir, "generation_config.json"))
    eos = _as_list(generation.get("eos_token_id", getattr(config, "eos_token_id", None)))
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{os.path.join(model_dir, 'config.json')}: architecture {architecture!r} is not supported; "
            f"shardserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quantized = getattr(config, "quantization_config", None)
    if quantized:  # its weights come with their own scales and layouts, which the loader does not read
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ValueError(
            f"{os.path.join(model_dir, 'config.json')}: a quantized checkpoint (quantization_config, method "
            f"{method!r}) is not supported; load the unquantized checkpoint (float32, bfloat16 or float16), with "
            "quantization='fp8' (--quantization fp8) for FP8 weights"
        )
    return ModelFacts(
        architecture=architecture,
        vocab_size=config.vocab_size,
        eos_token_ids=eos,
        bos_token_id=getattr(config, "bos_token_id", None),
        max_position_embeddings=config.max_position_embeddings,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        sliding_window=getattr(config, "sliding_window", None),  # Qwen2/Qwen3: only with use_sliding_window
        num_hidden_layers=config.num_hidden_layers,
    )


def model_facts(config: EngineConfig, tokenizer=None) -> ModelFacts:
    """The model's facts; the tokenizer's eos token stands in where the model's files name none."""
    facts = read_model_facts(config.model)
    if not facts.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        facts.eos_token_ids = [tokenizer.eos_token_id]
    return facts


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# The dtype "auto" takes on CPU, where set: float32 or bfloat16 (the test suite pins float32, tests/conftest.py)
CPU_DTYPE_ENV = "SHARDSERVE_CPU_DTYPE"


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX bfloat16 tile units (Intel Xeon since Sapphire Rapids), as torch sees them."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)  # (torch >= 2.8)
    return bool(capabilities and capabilities().get("amx_bf16"))


def cpu_bf16_fast(capabilities: dict | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively: AMX tiles (Intel Xeon since Sapphire Rapids) or AVX-512 BF16
    dot products (AMD EPYC Zen 4 and later, Intel Cooper Lake). Without either, bfloat16 is converted to float32
    around every product and is slower than float32. capabilities: torch.cpu.get_capabilities()'s dict (read here
    when None)."""
    if capabilities is None:
        import torch

        read = getattr(torch.cpu, "get_capabilities", None)  # (torch >= 2.8)
        capabilities = read() if read else {}
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def cpu_auto_dtype(bf16_fast: bool | None = None) -> str:
    """What dtype="auto" is on CPU: bfloat16 where the CPU multiplies it natively (cpu_bf16_fast: AMX or AVX-512
    BF16; the default model's offline benchmark runs 1.6x (AMD EPYC, AVX-512 BF16) to 2.1x (Xeon, AMX) faster than
    in float32 there: docs/performance.md), else float32. SHARDSERVE_CPU_DTYPE overrides the choice (float32 or
    bfloat16)."""
    chosen = os.environ.get(CPU_DTYPE_ENV)
    if chosen:
        chosen = DTYPE_ALIASES.get(chosen, chosen)
        if chosen not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_DTYPE_ENV} must be float32 or bfloat16, got {chosen!r}")
        return chosen
    if bf16_fast is None:
        bf16_fast = cpu_bf16_fast()
    return "bfloat16" if bf16_fast else "float32"


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else cpu_auto_dtype()
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
    return dtype


def _check_tensor_parallel_size(tp, facts: ModelFacts) -> None:
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


def _check_pipeline_parallel_size(pp, partition, facts: ModelFacts) -> None:
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
    layer_counts(facts.num_hidden_layers, pp, partition)  # each stage at least one layer; a partition adds up


# Tokens a step takes at most where max_num_batched_tokens is unset, on CUDA: 8192 for serving (a step with a long
# prompt's chunk in it holds up every running stream's next token for as long as the chunk takes), 16384 for an
# offline batch (LLM, `bench offline`): a prefill step's host work is per launch, not per token, and at 8192 the
# device waited for it, while the device's work doubles at 16384 (docs/performance-history.md).
MAX_NUM_BATCHED_TOKENS = {"serve": 8192, "offline": 16384}


def build_engine_config(*, offline: bool = False, **settings) -> EngineConfig:
    """User settings (any of EngineConfig's user fields; unset ones take their user default) -> the resolved
    EngineConfig. An unknown name is a TypeError, a bad value a ValueError. offline: the engine runs a batch
    (LLM, `bench offline`) rather than serving streams: larger steps by default (MAX_NUM_BATCHED_TOKENS)."""
    known = user_settings()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; the settings are {', '.join(known)}")
    s = {name: user_default(f) for name, f in known.items()} | settings
    for name, f in known.items():
        choices = f.metadata["choices"]
        if choices is not None and s[name] not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {s[name]!r}")
    resolved = resolve_model(s["model"], s["load_format"])
    facts = read_model_facts(resolved.model_dir)
    _check_tensor_parallel_size(s["tensor_parallel_size"], facts)
    _check_pipeline_parallel_size(s["pipeline_parallel_size"], s["pp_layer_partition"], facts)
    device = resolve_device(s["device"])
    max_model_len = s["max_model_len"]
    if max_model_len is None:
        max_model_len = facts.max_position_embeddings
        if device == "cpu":
            max_model_len = min(max_model_len, CPU_MAX_MODEL_LEN)
    elif max_model_len > facts.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {facts.max_position_embeddings}"
        )
    window = facts.sliding_window
    if window is not None and max_model_len > window:
        raise ValueError(
            f"{facts.architecture} uses sliding-window attention over {window} tokens, which shardserve does not "
            f"implement: set --max-model-len (max_model_len) to {window} or less, so every request fits in the window"
        )
    s.update(
        model=resolved.model_dir,
        tokenizer=resolved.tokenizer_dir,
        load_format=resolved.load_format,
        device=device,
        dtype=resolve_dtype(s["dtype"], device),
        max_model_len=max_model_len,
    )
    speculative = parse_speculative_config(s["speculative_config"])  # a dict or JSON text; ValueError if bad
    s["speculative_config"] = speculative.to_json() if speculative is not None else None
    if speculative is not None and s["async_scheduling"]:
        raise ValueError("speculative decoding plans each step from the tokens the last one accepted: it runs "
                         "without async scheduling (leave async_scheduling unset or False)")
    if s["kv_cache_dtype"] == "auto":  # the cache in the model's dtype, named so that records state it
        s["kv_cache_dtype"] = s["dtype"]
    if s["max_num_seqs"] is None:
        s["max_num_seqs"] = known["max_num_seqs"].default
    if s["max_num_batched_tokens"] is None:
        on_cuda = MAX_NUM_BATCHED_TOKENS["offline" if offline else "serve"]
        s["max_num_batched_tokens"] = on_cuda if device == "cuda" else 2048
    return EngineConfig(**s)
