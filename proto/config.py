"""EngineConfig: the one list of engine settings, and what every worker receives in Init.

Each field's metadata says what it is and how a user sets it:
- `help`: what the setting does;
- `user`: True for a user setting: it is an `LLM(...)` keyword and a command-line flag, both derived from this
  list (shardserve/settings/resolve.py, shardserve/cli/flags.py); False for what shardserve fills in itself;
- `flags`: the flag's spellings where they are not `--` + the name with dashes; `choices`: the allowed values;
  `off_flags`: older spellings that turn a default-on switch off (kept working, not shown in --help);
- `user_default`: the value a user leaves unset where it differs from the field's default: "auto" and None are
  resolved (device, dtype, the model folder, max_model_len ...) by shardserve/settings/resolve.py build_engine_config, so
  the dataclass itself only ever holds resolved values.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")  # "auto": safetensors from the model folder; "dummy": random weights
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 with a scale per layer and KV head
QUANTIZATIONS = ("none", "fp8")  # none: weights as loaded; fp8: the linear layers W8A8 (kernels/fp8_linear.py)


def _setting(default: Any = MISSING, *, help: str, user: bool = True, flags: tuple[str, ...] = (),
             choices: tuple | None = None, user_default: Any = MISSING, off_flags: tuple[str, ...] = ()) -> Any:
    metadata = {"help": help, "user": user, "flags": flags, "choices": choices, "off_flags": off_flags}
    if user_default is not MISSING:
        metadata["user_default"] = user_default
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    model: str = _setting(
        user_default=None,
        help="a local HF folder, a .gguf file or a built-in name (qwen3-0.6b, llama-3-8b, llama-3-70b); "
        "default: SmolLM2-135M-Instruct. Resolved: a local folder with config.json "
        "(+ safetensors unless load_format is dummy)")
    tokenizer: str | None = _setting(
        None, user=False, help="the folder with the tokenizer files (from the model); None: token ids only")
    tensor_parallel_size: int = _setting(
        1, flags=("-tp", "--tp", "--tensor-parallel-size"), help="tensor-parallel ranks (GPUs, or processes on CPU)")
    pipeline_parallel_size: int = _setting(
        1, flags=("-pp", "--pp", "--pipeline-parallel-size"),
        help="pipeline stages: the decoder layers split across them, each stage tensor_parallel_size ranks")
    pp_layer_partition: str | None = _setting(
        None, help="decoder layers per pipeline stage, comma-separated (e.g. 15,15); default: as even as can be")
    device: str = _setting("cpu", user_default="auto", choices=DEVICES, help="auto: cuda when available")
    dtype: str = _setting(
        "float32", user_default="auto",
        help="float32, bfloat16 or float16 (or fp32, bf16, fp16, half); auto: bfloat16 on CUDA and on CPUs with "
        "AMX bf16 units, else float32 (SHARDSERVE_CPU_DTYPE sets what auto is on CPU)")
    load_format: str = _setting("auto", choices=LOAD_FORMATS, help="auto: safetensors; dummy: random weights")
    block_size: int = _setting(16, help="tokens per KV-cache block (a power of two)")
    max_num_seqs: int = _setting(256, user_default=None, help="requests in one step at most (default 256)")
    max_num_batched_tokens: int = _setting(
        8192, user_default=None,
        help="tokens in one step at most (default: 8192 on CUDA, 16384 for an offline batch, 2048 on CPU)")
    max_model_len: int = _setting(
        4096, user_default=None,
        help="prompt + generated tokens of a request at most (default: the model's, capped at 4096 on CPU)")
    enable_prefix_caching: bool = _setting(
        True, flags=("--enable-prefix-caching",), off_flags=("--no-prefix-caching",),
        help="prefix caching: reuse the KV blocks of prompt prefixes seen before")
    block_events: bool = _setting(
        False, user=False,
        help="the controller records its prefix cache's block events (stored, evicted) for a router across engines "
        "(cluster/router.py): on for the server's replicas and LLM with data_parallel_size > 1")
    kv_cache_dtype: str = _setting(
        "auto", choices=KV_CACHE_DTYPES,
        help="auto: K/V cached in the model's dtype; fp8: float8 e4m3 with a scale per layer and KV head (the "
        "checkpoint's where it has them, else calibrated at start-up): twice the blocks, half the bytes read")
    quantization: str = _setting(
        "none", choices=QUANTIZATIONS,
        help="none: weights in the model's dtype; fp8: the decoder's linear layers in float8 e4m3 with a scale per "
        "output channel, activations quantized per token (W8A8): half the weights' bytes, FP8 tensor cores on CUDA")
    num_kv_blocks: int | None = _setting(None, help="fixes the KV cache's size in blocks (else measured)")
    kv_cache_memory_gb: float | None = _setting(
        None, help="sizes the KV cache in GiB (CPU default: 1 GiB; CUDA: from --gpu-memory-utilization)")
    gpu_memory_utilization: float = _setting(0.9, help="CUDA: the fraction of the device the process may use")
    attention_backend: str = _setting(
        "auto", choices=ATTENTION_BACKENDS, help="auto: flash-attn where importable, else triton on CUDA, else torch")
    split_mixed_decodes: int = _setting(
        0, help="CUDA, triton attention: a step that mixes decodes and prefills and starts with at least N decodes "
        "runs those on the decode kernel, the rest on the prefill kernel (two launches); 0: one launch")
    enforce_eager: bool = _setting(False, help="CUDA: no CUDA graphs")
    async_scheduling: bool | None = _setting(
        None, help="plan step N+1 while step N runs (default: on for CUDA, off for CPU)")
    seed: int = _setting(
        0, flags=("--seed",),
        help="the engine's seed: dummy weights, and the sampling seed of every request that gives none (drawn in "
        "admission order), so one seed and the same requests give the same outputs")
    speculative_config: str | None = _setting(
        None, user_default=None,
        help="speculative decoding as vLLM takes it, a JSON object (LLM: a dict): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, '
        '"disable_by_batch_size": 8}; off when unset (proto/speculative.py). Turns async scheduling off')
    dist_timeout_s: float = _setting(
        60.0, user=False, help="torch.distributed timeout in seconds: never the 30-minute default")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pp_layer_partition is not None:
            parse_layer_partition(self.pp_layer_partition, self.pipeline_parallel_size)
        if self.pipeline_parallel_size > 1 and self.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype fp8 is not supported with pipeline_parallel_size > 1 yet")
        if self.pipeline_parallel_size > 1 and self.speculative_config:
            raise ValueError("speculative decoding is not supported with pipeline_parallel_size > 1 yet")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.split_mixed_decodes < 0:
            raise ValueError(f"split_mixed_decodes must be >= 0, got {self.split_mixed_decodes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def parse_layer_partition(text: str, stages: int) -> list[int]:
    """"15,15" -> [15, 15]: one positive layer count per pipeline stage (ValueError otherwise)."""
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated layer counts, got {text!r}") from None
    if len(counts) != stages or min(counts) < 1:
        raise ValueError(f"pp_layer_partition needs {stages} positive layer counts (one per pipeline stage), "
                         f"got {text!r}")
    return counts


def user_settings() -> dict[str, Field]:
    """The user settings by name, in declaration order: LLM's keywords and the CLI's engine flags."""
    return {f.name: f for f in fields(EngineConfig) if f.metadata["user"]}


def user_default(f: Field) -> Any:
    """What a user setting is when the user leaves it unset (before build_engine_config resolves it)."""
    return f.metadata.get("user_default", f.default)
