"""The cases the attention timings run (bench/attention_rates.py): a random paged cache on a model's per-rank
attention shape, each sequence's blocks scattered over a cache twice the needed size, one query token per sequence,
in enough copies to read past the L2 cache; and the CUDA-graph timing they are measured with."""

from __future__ import annotations

import torch

from shardserve.proto.plan import cdiv

BLOCK_SIZE = 16


def graph_ms(fns: list, launches: int = 24, rounds: int = 7) -> float:
    """Median device ms per call of fns (one per copy of the data, taken in turn), from CUDA-graph replays."""
    for fn in fns:  # compile and warm up (on a side stream, as graph capture wants)
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = [fns[i % len(fns)] for i in range(max(launches, len(fns)))]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def copies(kv_bytes: int) -> int:
    """Copies of a case so that the launches in turn read 4x the L2 cache (1 for a case larger than that)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, min(16, -(-4 * l2 // kv_bytes)))


def make_cases(heads: int, kv_heads: int, dim: int, batch: int, context: int, cache_dtype: str,
           contexts: list[int] | None = None) -> tuple[list[dict], int]:
    """The copies of one case (enough to read past the L2 cache) and the K/V bytes one launch must read (contexts:
    as in case)."""
    kv_bytes = sum(contexts or [context] * batch) * kv_heads * dim * 2 * (1 if cache_dtype == "fp8" else 2)
    return [case(heads, kv_heads, dim, batch, context, cache_dtype, "cuda", contexts)
            for _ in range(copies(kv_bytes))], kv_bytes


def case(heads: int, kv_heads: int, dim: int, batch: int, context: int, cache_dtype: str, device,
          contexts: list[int] | None = None) -> dict:
    """contexts: each sequence's own context (batch of them, none over context), else context for every one."""
    from shardserve.kernels.kv_fp8 import quantize_fp8

    contexts = contexts or [context] * batch
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
        tables=tables, seq_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device), scales=scales,
        kv_bytes=sum(contexts) * kv_heads * dim * 2 * k_cache.element_size(),
    )


def model_shape(model: str) -> tuple[int, int, int]:
    from transformers import AutoConfig

    from shardserve.settings.model_source import resolve_model

    hf = AutoConfig.from_pretrained(resolve_model(model, "dummy").model_dir)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    return heads, kv_heads, getattr(hf, "head_dim", None) or hf.hidden_size // heads


def spread_contexts(batch: int, low: int, high: int, seed: int = 0) -> list[int]:
    """batch contexts evenly spread over [low, high], in a shuffled order (what a running batch of requests of
    unequal lengths holds)."""
    import random

    step = (high - low) / max(1, batch - 1)
    contexts = [round(low + i * step) for i in range(batch)]
    random.Random(seed).shuffle(contexts)
    return contexts
