"""The hardware ceiling of a benchmark: bytes a step must read over the measured copy bandwidth, FLOPs over the
measured matmul rate, whichever is slower, summed over the steps of the actual workload.

Rates are measured in the same run (measure_rates): a large device-to-device copy (bandwidth counts bytes read +
written, as copy benchmarks do) and a bf16 n^3 matmul. Per rank and per step:
  memory time  = (weights read + KV read) / copy bandwidth
  compute time = (2 x linear parameters x tokens + attention FLOPs) / matmul rate
The ideal schedule holds every unfinished sequence in the batch (the workload's KV fits an H200 at once): decode
step k holds the sequences with more than k output tokens, each reading its context (prompt + k tokens) of K and
V. Prefill is compute (its weight reads are amortised over thousands of tokens), and a scheduler that mixes prefill
chunks into decode steps hides it in the compute slack of memory-bound steps: the ceiling's time is the sum of the
decode steps' max(memory, compute) plus whatever prefill compute exceeds that slack. The ceiling is output tokens
over that time; the arithmetic also shows the serial schedule (all prefill first).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardserve.proto.plan import cdiv

# FP8 tensor-core products against bf16's (quantization="fp8"): the H100/H200 datasheets' dense rates, 1,979 against
# 989 TFLOP/s (an assumption, not measured here: the measured matmul is bf16).
FP8_MATMUL_SPEEDUP = 2.0


@dataclass
class DeviceRates:
    device: str
    copy_bytes_per_s: float  # (read + written) bytes per second of a large device-to-device copy
    matmul_flops_per_s: float  # bf16 (fp32 on CPU) n^3 matmul
    copy_bytes: int  # size of the copied tensor
    matmul_n: int

    def describe(self) -> str:
        return (f"measured on {self.device}: copy {self.copy_bytes_per_s / 1e12:.2f} TB/s (read+write, "
                f"{self.copy_bytes / 2**30:.2f} GiB tensor), matmul {self.matmul_flops_per_s / 1e12:.1f} TFLOP/s "
                f"({self.matmul_n}^3)")


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median ms of fn over repeats (after one warm-up), CUDA events on the GPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _time_copy(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device, repeats)


def _time_matmul(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return time_ms(lambda: torch.mm(a, b), device, repeats)


def measure_rates(device: str = "cuda", copy_bytes: int | None = None, matmul_n: int | None = None,
                  repeats: int = 10) -> DeviceRates:
    """Copy bandwidth and matmul rate of this device (defaults: 2 GiB and 8192^3 bf16 on CUDA; small on CPU)."""
    dev = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    on_gpu = dev.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if on_gpu else 64 << 20)
    matmul_n = matmul_n or (8192 if on_gpu else 512)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    copy_ms = _time_copy(copy_bytes, dev, repeats)
    matmul_ms = _time_matmul(matmul_n, dtype, dev, repeats)
    if on_gpu:
        torch.cuda.empty_cache()  # the engine measures free memory next
        torch.cuda.reset_peak_memory_stats(dev)  # and the benchmark's peak memory is the engine's
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    return DeviceRates(name, 2 * copy_bytes / (copy_ms / 1e3), 2 * matmul_n**3 / (matmul_ms / 1e3), copy_bytes, matmul_n)


@dataclass
class ModelShape:
    """One rank's share of a Llama/Qwen-style decoder, enough to count bytes and FLOPs."""

    num_layers: int
    hidden: int
    heads: int  # per rank
    kv_heads: int  # per rank (replicated when tp > KV heads)
    head_dim: int
    intermediate: int  # per rank
    vocab_rows: int  # LM head rows per rank
    dtype_bytes: int
    tp: int
    kv_dtype_bytes: int | None = None  # bytes per cached K/V element (1 for an FP8 cache); None: dtype_bytes
    fp8_linear: bool = False  # quantization="fp8": linear weights 1 byte each, their products at FP8_MATMUL_SPEEDUP

    @classmethod
    def from_hf_config(cls, cfg: Any, tp: int = 1, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None) -> "ModelShape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads // tp, max(1, kv // tp), head_dim,
                   cfg.intermediate_size // tp, cdiv(cfg.vocab_size, tp), dtype_bytes, tp, kv_dtype_bytes)

    @classmethod
    def of_engine(cls, config: Any) -> "ModelShape":
        """The shape of a resolved EngineConfig's model at its TP size, dtype and KV-cache dtype."""
        from transformers import AutoConfig

        sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
        kv = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else config.dtype
        shape = cls.from_hf_config(AutoConfig.from_pretrained(config.model), config.tensor_parallel_size,
                                   sizes[config.dtype], sizes[kv])
        shape.fp8_linear = getattr(config, "quantization", "none") == "fp8" and config.device == "cuda"
        return shape

    @property
    def linear_params_per_layer(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return qkv + out + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab_rows * self.hidden

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads on one rank: every linear layer, norms and the LM head (the
        embedding reads only the batch's rows)."""
        norms = self.num_layers * (2 * self.hidden + 2 * self.head_dim) + self.hidden
        linear_bytes = 1 if self.fp8_linear else self.dtype_bytes
        return (self.num_layers * self.linear_params_per_layer * linear_bytes
                + (self.lm_head_params + norms) * self.dtype_bytes)

    @property
    def linear_rate_factor(self) -> float:
        """The linear layers' products' rate over the measured (bf16) matmul rate."""
        return FP8_MATMUL_SPEEDUP if self.fp8_linear else 1.0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, every layer, on one rank (an FP8 cache's per-head scales are a few bytes per layer,
        read once per program: not counted)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def attention_flops(self, query_tokens: float, key_reads: float) -> float:
        """QK^T and PV: 2 FLOPs per multiply-add, 2 products per (query head, key) pair, per layer."""
        del query_tokens
        return 4.0 * self.num_layers * self.heads * self.head_dim * key_reads


def workload_ceiling(shape: ModelShape, rates: DeviceRates, input_lens: list[int], output_lens: list[int]) -> dict:
    """The ideal schedule of the module doc over this workload; returns the numbers and the arithmetic as text."""
    import numpy as np

    inputs = np.asarray(input_lens, dtype=np.float64)
    outputs = np.asarray(output_lens, dtype=np.float64)
    bw, rate = rates.copy_bytes_per_s, rates.matmul_flops_per_s
    # Prefill: every prompt token through the linear layers, causal attention (sum of L(L+1)/2 keys), and one
    # LM-head row per prompt (its first output token).
    linear_prefill_flops = 2.0 * shape.num_layers * shape.linear_params_per_layer * inputs.sum()
    other_prefill_flops = (2.0 * shape.lm_head_params * len(inputs)
                           + shape.attention_flops(inputs.sum(), (inputs * (inputs + 1) / 2).sum()))
    prefill_flops = linear_prefill_flops + other_prefill_flops
    prefill_s = (linear_prefill_flops / shape.linear_rate_factor + other_prefill_flops) / rate
    decode_memory_s = decode_compute_s = decode_s = 0.0
    steps = int(outputs.max()) - 1 if len(outputs) else 0
    weight_s = shape.decode_weight_bytes / bw
    # a token's linear FLOPs, counted at the matmul rate (FP8 products at linear_rate_factor times it)
    flops_per_token = 2.0 * (shape.num_layers * shape.linear_params_per_layer / shape.linear_rate_factor
                             + shape.lm_head_params)
    for k in range(1, steps + 1):
        active = outputs > k
        batch = int(active.sum())
        context = (inputs[active] + k).sum()
        memory = weight_s + context * shape.kv_bytes_per_token / bw
        compute = (batch * flops_per_token + shape.attention_flops(batch, context)) / rate
        decode_memory_s += memory
        decode_compute_s += compute
        decode_s += max(memory, compute)
    slack_s = decode_s - decode_compute_s if decode_s > 0 else 0.0  # compute idle time inside the decode steps
    total_s = decode_s + max(0.0, prefill_s - slack_s)
    serial_s = prefill_s + decode_s
    out_tokens = float(outputs.sum())
    ceiling = out_tokens / total_s if total_s > 0 else None
    lines = [
        rates.describe(),
        f"per rank (tp={shape.tp}): weights read per decode step {shape.decode_weight_bytes / 1e9:.3f} GB "
        f"-> {weight_s * 1e3:.3f} ms; KV per token {shape.kv_bytes_per_token / 1024:.1f} KiB "
        f"({shape.kv_dtype_bytes or shape.dtype_bytes} bytes per element)"
        + (f"; linear weights FP8, their products at {shape.linear_rate_factor:g}x the matmul rate"
           if shape.fp8_linear else ""),
        f"prefill: {inputs.sum():.0f} prompt tokens, {prefill_flops / 1e12:.1f} TFLOP -> {prefill_s:.3f} s",
        f"decode: {steps} steps (batch {len(outputs)} -> 1), memory {decode_memory_s:.3f} s, compute "
        f"{decode_compute_s:.3f} s, sum of per-step max {decode_s:.3f} s",
        f"prefill hidden in the {slack_s:.3f} s of compute slack of memory-bound decode steps: "
        f"{max(0.0, prefill_s - slack_s):.3f} s left over",
        f"ceiling: {out_tokens:.0f} output tokens / {total_s:.3f} s = {ceiling or 0:.0f} output tok/s "
        f"(all prefill first instead: {out_tokens / serial_s if serial_s else 0:.0f})",
    ]
    return dict(
        ceiling_output_tokens_per_s=ceiling, time_s=total_s, prefill_s=prefill_s, decode_s=decode_s, decode_memory_s=decode_memory_s,
        decode_compute_s=decode_compute_s, decode_steps=steps, weight_bytes_per_step=shape.decode_weight_bytes,
        kv_bytes_per_token=shape.kv_bytes_per_token, rates=asdict(rates), arithmetic=lines,
    )


def weight_read_bound_ms(shape: ModelShape, rates: DeviceRates) -> float:
    """bs=1 decode cannot beat reading one rank's weights once per token."""
    return shape.decode_weight_bytes / rates.copy_bytes_per_s * 1e3
