"""EngineConfig: the one configuration both sides read (built by shardserve/ from CLI flags or LLM kwargs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str  # a resolved local folder with config.json (+ safetensors unless load_format="dummy")
    tokenizer: str | None = None  # folder with the tokenizer files; None = token ids only (dummy configs)
    tensor_parallel_size: int = 1
    device: str = "cpu"  # "cpu" or "cuda" (resolved from "auto" by shardserve/)
    dtype: str = "float32"  # "float32", "bfloat16" or "float16" (resolved from "auto")
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # fixes the cache size (tests force preemption with it)
    kv_cache_memory_gb: float | None = None  # else: this much memory for the cache (CPU default 1 GiB)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device the process may use in all
    attention_backend: str = "auto"  # "auto", "torch", "triton" or "flash-attn"
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None = on for CUDA, off for CPU
    seed: int = 0  # dummy weights' seed
    dist_timeout_s: float = 60.0  # torch.distributed timeout: never the 30-minute default

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
