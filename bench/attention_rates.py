"""Achieved bytes/s of each attention kernel (`bench probe --attention-rates`), bf16 and FP8 caches, against the
device's measured copy rate.

Per (cache dtype, batch, context): a random paged cache on the model's per-rank attention shape (TP=1), each
sequence's blocks scattered over a cache twice the needed size (a random permutation: what preemption and prefix
hits leave), one query token per sequence. Timed: the split-K decode kernel (its default launch settings and
choose_num_splits, as the backend runs it; for FP8 each of its FP8_DECODE_VARIANTS) and the varlen prefill kernel on the same decodes (the path a mixed
batch's decodes take). Bytes: the K and V the batch's contexts hold (every one is read once); the queries, outputs
and block tables are under 1% of it and not counted. The copy rate counts read + written bytes, as the roofline does.
"""

from __future__ import annotations

import torch

from shardserve.proto.plan import cdiv

BLOCK_SIZE = 16


def _events_ms(fn, repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _case(heads: int, kv_heads: int, dim: int, batch: int, context: int, cache_dtype: str, device) -> dict:
    from shardserve.kernels.kv_fp8 import quantize_fp8

    blocks_each = cdiv(context, BLOCK_SIZE)
    num_blocks = 2 * batch * blocks_each
    shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    scales = {}
    if cache_dtype == "fp8":
        scale = torch.full((kv_heads,), 4.0 / 448, device=device)
        k_cache, v_cache = quantize_fp8(k_cache, scale), quantize_fp8(v_cache, scale)
        scales = dict(k_scale=scale, v_scale=scale)
    tables = torch.randperm(num_blocks, device=device)[: batch * blocks_each].view(batch, blocks_each).to(torch.int32)
    return dict(
        q=torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=device), k_cache=k_cache, v_cache=v_cache,
        tables=tables, seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device), scales=scales,
        kv_bytes=batch * context * kv_heads * dim * 2 * k_cache.element_size(),
    )


def attention_rates(model: str, shapes: list[tuple[int, int]], copy_bytes_per_s: float,
                    cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8"), repeats: int = 20) -> list[dict]:
    from transformers import AutoConfig

    from shardserve.kernels.paged_decode import FP8_DECODE_VARIANTS, choose_num_splits, paged_decode_attention
    from shardserve.kernels.prefill import paged_prefill_attention
    from shardserve.models import resolve_model

    hf = AutoConfig.from_pretrained(resolve_model(model, "dummy").model_dir)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    device = torch.device("cuda")
    rows = []
    for cache_dtype in cache_dtypes:
        for batch, context in shapes:
            c = _case(heads, kv_heads, dim, batch, context, cache_dtype, device)
            splits = choose_num_splits(batch, kv_heads, context)
            variants = FP8_DECODE_VARIANTS if cache_dtype == "fp8" else ("widen",)
            kernels = {
                "decode" + (f"[{v}]" if cache_dtype == "fp8" else ""): (
                    lambda v=v: paged_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"],
                                                       dim**-0.5, splits, **c["scales"], fp8_variant=v))
                for v in variants
            }
            kernels |= {
                "prefill_kernel_on_decodes": lambda: paged_prefill_attention(
                    c["q"], c["k_cache"], c["v_cache"], c["query_start_loc"], c["seq_lens"], c["tables"], dim**-0.5,
                    **c["scales"]),
            }
            for kernel, fn in kernels.items():
                ms = _events_ms(fn, repeats)
                rate = c["kv_bytes"] / (ms / 1e3)
                rows.append(dict(kernel=kernel, kv_cache_dtype=cache_dtype, batch=batch, context=context,
                                 splits=splits if kernel.startswith("decode") else None, ms=ms, kv_bytes=c["kv_bytes"],
                                 bytes_per_s=rate, fraction_of_copy_rate=rate / copy_bytes_per_s))
                print(f"attention {kernel:28s} {cache_dtype:8s} batch {batch:4d} x {context:5d}: {ms:.3f} ms, "
                      f"{rate / 1e12:.2f} TB/s ({rate / copy_bytes_per_s:.0%} of copy)", flush=True)
            del c
    return rows
