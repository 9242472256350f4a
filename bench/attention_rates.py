"""Achieved bytes/s of each attention kernel (`bench probe --attention-rates`), bf16 and FP8 caches, against the
device's measured copy rate.

Per (cache dtype, batch, context): a random paged cache on the model's per-rank attention shape (TP=1), each
sequence's blocks scattered over a cache twice the needed size (a random permutation: what preemption and prefix
hits leave), one query token per sequence. Timed: the split-K decode kernel (its default launch settings, FP8 loop
and choose_num_splits, as the backend runs it) and the varlen prefill kernel on the same decodes (the path a mixed
batch's decodes take). Bytes: the K and V the batch's contexts hold (every one is read once); the queries, outputs
and block tables are under 1% of it and not counted. The copy rate counts read + written bytes, as the roofline does.

Timing: one CUDA graph of ~24 launches back to back, replayed (the way the decode graphs run the kernel: no host
launch cost inside the figure), over several copies of the case in turn where one copy would fit in the L2 cache
(so every launch reads its K/V from device memory); the median replay over the launches in it.
`sweep` times the decode kernel over launch settings (keys per tile, warps, stages, splits) and FP8 loops
(FP8_DECODE_VARIANTS) the same way.
"""

from __future__ import annotations

import torch

from shardserve.bench.attention_cases import graph_ms, make_cases, model_shape, spread_contexts

def ragged(model: str, specs: list[tuple[int, int, int]], copy_bytes_per_s: float) -> list[dict]:
    """The decode kernel on batches of unequal contexts (BATCH, LOW, HIGH: spread_contexts), its programs started
    in batch order and longest first (as the backend starts them), next to a batch of equal contexts holding as
    many tokens (the probe's usual case): how much a batch's long tail costs, and how much the order wins back.
    Longest first is also timed at 2x and 4x choose_num_splits' splits (more, shorter programs for the long
    contexts: what a batch too small to fill the GPU twice over may need)."""
    from shardserve.kernels.paged_decode import choose_num_splits
    from shardserve.kernels.decode_order import longest_first

    heads, kv_heads, dim = model_shape(model)
    out = []
    for cache_dtype in ("bfloat16", "fp8"):
        for batch, low, high in specs:
            contexts = spread_contexts(batch, low, high)
            cases, kv_bytes = make_cases(heads, kv_heads, dim, batch, high, cache_dtype, contexts)
            splits = choose_num_splits(batch, kv_heads, high)
            row = dict(kv_cache_dtype=cache_dtype, batch=batch, contexts=f"{low}-{high}", splits=splits,
                       kv_bytes=kv_bytes)
            row["batch_order_ms"] = graph_ms([_decode(c, splits) for c in cases])
            row["longest_first_ms"] = graph_ms([_decode(c, splits, order=longest_first(c["seq_lens"])) for c in cases])
            for more in (2, 4):
                row[f"longest_first_{more}x_splits_ms"] = graph_ms(
                    [_decode(c, more * splits, order=longest_first(c["seq_lens"])) for c in cases])
            del cases
            mean = round(sum(contexts) / batch)
            even, _ = make_cases(heads, kv_heads, dim, batch, mean, cache_dtype)
            row["equal_contexts_ms"] = graph_ms([_decode(c, choose_num_splits(batch, kv_heads, mean)) for c in even])
            del even
            for key in ("batch_order", "longest_first"):
                row[f"{key}_fraction_of_copy_rate"] = kv_bytes / (row[f"{key}_ms"] / 1e3) / copy_bytes_per_s
            out.append(row)
            print(f"ragged {cache_dtype:8s} {batch} x {low}-{high}: batch order {row['batch_order_ms']:.4f} ms "
                  f"({row['batch_order_fraction_of_copy_rate']:.0%} of copy), longest first "
                  f"{row['longest_first_ms']:.4f} ms ({row['longest_first_fraction_of_copy_rate']:.0%}; splits x2 "
                  f"{row['longest_first_2x_splits_ms']:.4f}, x4 {row['longest_first_4x_splits_ms']:.4f}), "
                  f"equal contexts of {mean} {row['equal_contexts_ms']:.4f} ms", flush=True)
    return out


def _decode(c: dict, splits: int, **launch):
    from shardserve.kernels.paged_decode import paged_decode_attention

    dim = c["q"].shape[-1]
    return lambda: paged_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], dim**-0.5,
                                          splits, **c["scales"], **launch)


def attention_rates(model: str, shapes: list[tuple[int, int]], copy_bytes_per_s: float,
                    cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8")) -> list[dict]:
    from shardserve.kernels.paged_decode import choose_num_splits
    from shardserve.kernels.prefill import paged_prefill_attention

    heads, kv_heads, dim = model_shape(model)
    rows = []
    for cache_dtype in cache_dtypes:
        for batch, context in shapes:
            cases, kv_bytes = make_cases(heads, kv_heads, dim, batch, context, cache_dtype)
            splits = choose_num_splits(batch, kv_heads, context)
            kernels = {"decode": [_decode(c, splits) for c in cases]}
            kernels["prefill_kernel_on_decodes"] = [
                (lambda c=c: paged_prefill_attention(c["q"], c["k_cache"], c["v_cache"], c["query_start_loc"],
                                                     c["seq_lens"], c["tables"], dim**-0.5, **c["scales"]))
                for c in cases]
            for kernel, fns in kernels.items():
                ms = graph_ms(fns)
                rate = kv_bytes / (ms / 1e3)
                rows.append(dict(kernel=kernel, kv_cache_dtype=cache_dtype, batch=batch, context=context,
                                 splits=splits if kernel == "decode" else None, ms=ms, kv_bytes=kv_bytes,
                                 copies=len(cases), bytes_per_s=rate, fraction_of_copy_rate=rate / copy_bytes_per_s))
                print(f"attention {kernel:28s} {cache_dtype:8s} batch {batch:4d} x {context:5d}: {ms:.4f} ms, "
                      f"{rate / 1e12:.2f} TB/s ({rate / copy_bytes_per_s:.0%} of copy)", flush=True)
            del cases, kernels
    return rows


SWEEP = {  # (BLOCK_N, warps, stages, FP8 variant) per cache
    "bfloat16": [(64, 4, 2, None), (64, 4, 3, None), (64, 8, 2, None)],
    "fp8": [(128, 4, 2, "fp16"), (128, 4, 3, "fp16"), (128, 8, 2, "fp16"), (256, 8, 2, "fp16"),
            (128, 4, 2, "pairs"), (128, 4, 3, "pairs"), (128, 8, 2, "pairs"), (64, 4, 2, "pairs"), (256, 4, 2, "pairs"),
            (256, 8, 2, "pairs")],
}


def sweep(model: str, shapes: list[tuple[int, int]], copy_bytes_per_s: float,
          cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8"), variants: set[str] | None = None) -> list[dict]:
    """The decode kernel over SWEEP's settings x (choose_num_splits' splits, twice that) per shape and cache
    (variants: only these FP8 loops). Each FP8 row also gives its largest difference from the default loop's
    output on the first copy of the case."""
    from shardserve.kernels.paged_decode import choose_num_splits

    heads, kv_heads, dim = model_shape(model)
    rows = []
    for cache_dtype in cache_dtypes:
        for batch, context in shapes:
            cases, kv_bytes = make_cases(heads, kv_heads, dim, batch, context, cache_dtype)
            chosen = choose_num_splits(batch, kv_heads, context)
            baseline = _decode(cases[0], chosen)() if cache_dtype == "fp8" else None
            best = None
            for block_n, warps, stages, variant in SWEEP[cache_dtype]:
                if variants and variant and variant not in variants:
                    continue
                for splits in (chosen, 2 * chosen):
                    row = dict(kv_cache_dtype=cache_dtype, batch=batch, context=context, block_n=block_n,
                               warps=warps, stages=stages, variant=variant, splits=splits, chosen_splits=chosen)
                    launch = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                    if variant:
                        launch["fp8_variant"] = variant
                    try:
                        row["ms"] = graph_ms([_decode(c, splits, **launch) for c in cases])
                    except Exception as exc:  # a setting this GPU cannot compile (shared memory): noted
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        rows.append(row)
                        continue
                    row["fraction_of_copy_rate"] = kv_bytes / (row["ms"] / 1e3) / copy_bytes_per_s
                    if baseline is not None:
                        out = _decode(cases[0], splits, **launch)()
                        row["max_abs_diff_vs_default"] = float((out.float() - baseline.float()).abs().max())
                        row["baseline_max_abs"] = float(baseline.float().abs().max())
                    print(f"  {cache_dtype} {batch}x{context} {block_n},{warps},{stages} {variant} splits {splits}: "
                          f"{row['ms']:.4f} ms ({row['fraction_of_copy_rate']:.0%})"
                          + (f" diff {row['max_abs_diff_vs_default']:.3g}" if baseline is not None else ""), flush=True)
                    rows.append(row)
                    best = row if best is None or row["ms"] < best["ms"] else best
            if best:
                print(f"sweep {cache_dtype:8s} {batch:4d} x {context:5d}: best {best['block_n']},{best['warps']},"
                      f"{best['stages']} {best['variant']} splits {best['splits']}: {best['ms']:.4f} ms "
                      f"({best['fraction_of_copy_rate']:.0%} of copy)", flush=True)
            del cases
    return rows


def padded_rows(model: str, shapes: list[tuple[int, int]], rows: list[int], copy_bytes_per_s: float) -> list[dict]:
    """The decode kernel with its query group padded to each of rows (16 is what it runs): how its time grows with
    the products' and softmax's rows says how much of it is per-row work rather than bytes."""
    from shardserve.kernels.paged_decode import choose_num_splits

    heads, kv_heads, dim = model_shape(model)
    out = []
    for cache_dtype, variants in (("bfloat16", [None]), ("fp8", ["fp16", "pairs"])):
        for batch, context in shapes:
            cases, kv_bytes = make_cases(heads, kv_heads, dim, batch, context, cache_dtype)
            splits = choose_num_splits(batch, kv_heads, context)
            for variant in variants:
                for block_g in rows:
                    launch = dict(block_g=block_g) | (dict(fp8_variant=variant) if variant else {})
                    ms = graph_ms([_decode(c, splits, **launch) for c in cases])
                    out.append(dict(kv_cache_dtype=cache_dtype, variant=variant, batch=batch, context=context,
                                    rows=block_g, splits=splits, ms=ms,
                                    fraction_of_copy_rate=kv_bytes / (ms / 1e3) / copy_bytes_per_s))
                    print(f"rows {cache_dtype} {variant} {batch}x{context} rows {block_g}: {ms:.4f} ms "
                          f"({out[-1]['fraction_of_copy_rate']:.0%})", flush=True)
            del cases
    return out


def mixed_split(model: str, shapes: list[tuple[int, int]], prefill_tokens: int, copy_bytes_per_s: float) -> list[dict]:
    """A mixed batch (batch - 1 decodes, then one sequence extending its context by prefill_tokens) through the Triton
    backend as one prefill-kernel launch (split_mixed_decodes 0) and split (1: the decodes on the decode kernel),
    per cache: whether the split pays for its second launch."""
    from shardserve.kernels.backends import AttentionMetadata
    from shardserve.kernels.triton_backend import TritonAttentionBackend

    heads, kv_heads, dim = model_shape(model)
    out = []
    for cache_dtype in ("bfloat16", "fp8"):
        for batch, context in shapes:
            cases, kv_bytes = make_cases(heads, kv_heads, dim, batch, context, cache_dtype)
            tokens = min(prefill_tokens, context)
            query_lens = [1] * (batch - 1) + [tokens]
            for c in cases:
                c["q"] = torch.randn(batch - 1 + tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
                c["meta"] = AttentionMetadata(
                    slot_mapping=torch.full((batch - 1 + tokens,), -1, dtype=torch.int64, device="cuda"),
                    query_start_loc=torch.tensor([0, *range(1, batch), batch - 1 + tokens], dtype=torch.int32,
                                                 device="cuda"),
                    seq_lens=c["seq_lens"], block_tables=c["tables"], query_lens_cpu=query_lens,
                    seq_lens_cpu=[context] * batch, max_query_len=tokens, max_seq_len=context)
            row = dict(kv_cache_dtype=cache_dtype, batch=batch, context=context, prefill_tokens=tokens)
            for name, split_mixed in (("one_launch_ms", 0), ("split_ms", 1)):
                backend = TritonAttentionBackend(split_mixed=split_mixed)
                row[name] = graph_ms([(lambda c=c: backend.attend(c["q"], c["k_cache"], c["v_cache"], c["meta"],
                                                                  dim**-0.5, **c["scales"])) for c in cases])
            row["fraction_of_copy_rate_split"] = kv_bytes / (row["split_ms"] / 1e3) / copy_bytes_per_s
            out.append(row)
            print(f"mixed {cache_dtype:8s} {batch - 1} decodes x {context} + {tokens} prefill: one launch "
                  f"{row['one_launch_ms']:.4f} ms, split {row['split_ms']:.4f} ms "
                  f"({row['one_launch_ms'] / row['split_ms']:.2f}x)", flush=True)
            del cases
    return out


def _shapes(text: str) -> list[tuple[int, int]]:
    """"32x256,64x4096" -> [(32, 256), (64, 4096)] (batch, context); "" -> []."""
    shapes, spread = split_specs(text)
    if spread:
        raise ValueError(f"expected BATCHxCONTEXT here (BATCHxLOW-HIGH goes to --ragged), got {text!r}")
    return shapes


def _spread(text: str) -> list[tuple[int, int, int]]:
    """"64x100-4096,32x100-2048" -> [(64, 100, 4096), (32, 100, 2048)] (batch, low, high); "" -> []."""
    shapes, spread = split_specs(text)
    if shapes:
        raise ValueError(f"expected BATCHxLOW-HIGH here (BATCHxCONTEXT goes to --shapes), got {text!r}")
    return spread


def split_specs(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """"64x1024,128x100-2048" -> ([(64, 1024)], [(128, 100, 2048)]): equal contexts (BATCHxCONTEXT) and unequal
    ones (BATCHxLOW-HIGH, for ragged)."""
    shapes, spread = [], []
    for spec in filter(None, text.split(",")):
        batch, _, contexts = spec.partition("x")
        low, dash, high = contexts.partition("-")
        try:
            if dash:
                spread.append((int(batch), int(low), int(high)))
                if not 0 < spread[-1][1] <= spread[-1][2]:
                    raise ValueError
            else:
                shapes.append((int(batch), int(contexts)))
        except ValueError:
            raise ValueError(f"expected BATCHxCONTEXT or BATCHxLOW-HIGH (LOW <= HIGH), got {spec!r}") from None
    return shapes, spread


def main(argv: list[str] | None = None) -> int:
    """python -m shardserve.bench.attention_rates --model M --shapes 32x256,64x4096 [--sweep] --json-out F"""
    import argparse
    import json

    from shardserve.bench.roofline import measure_rates

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="qwen3-0.6b", help="model whose attention shape is timed")
    parser.add_argument("--shapes", default="32x256,32x1024,32x4096,64x1024,64x4096,128x2048,256x800",
                        help="BATCHxCONTEXT,...")
    parser.add_argument("--sweep", action="store_true", help="the decode kernel's launch settings too")
    parser.add_argument("--sweep-shapes", default="32x1024,32x4096,64x1024,64x4096,256x800",
                        help="BATCHxCONTEXT,... for --sweep")
    parser.add_argument("--sweep-variants", default="", help="FP8 loops to sweep, e.g. pairs (default: all)")
    parser.add_argument("--padded-rows", default="", help="time the decode kernel with the group padded to these "
                        "rows, e.g. 16,32,64, at --sweep-shapes")
    parser.add_argument("--mixed", default="", help="time mixed batches (BATCHxCONTEXT,...: batch - 1 decodes and one "
                        "extend) as one launch and split (the setting split_mixed_decodes)")
    parser.add_argument("--mixed-prefill", type=int, default=512, help="the extend's new tokens in --mixed")
    parser.add_argument("--ragged", default="", help="time batches of unequal contexts in batch order and longest "
                        "first (BATCHxLOW-HIGH,..., e.g. 192x100-2048)")
    parser.add_argument("--json-out", help="write the rows here")
    args = parser.parse_args(argv)
    # every spec parsed first: a malformed one (or one given to the wrong flag) fails now, not after the timings
    shapes, spread, sweep_shapes, mixed = (_shapes(args.shapes), _spread(args.ragged), _shapes(args.sweep_shapes),
                                           _shapes(args.mixed))
    copy = measure_rates("cuda", matmul_n=1024).copy_bytes_per_s
    report = {"model": args.model, "copy_bytes_per_s": copy, "rows": attention_rates(args.model, shapes, copy)}
    if args.ragged:
        report["ragged"] = ragged(args.model, spread, copy)
    if args.sweep:
        report["sweep"] = sweep(args.model, sweep_shapes, copy,
                                variants=set(filter(None, args.sweep_variants.split(","))) or None)
    if args.padded_rows:
        report["padded_rows"] = padded_rows(args.model, sweep_shapes,
                                            [int(r) for r in args.padded_rows.split(",")], copy)
    if args.mixed:
        report["mixed"] = mixed_split(args.model, mixed, args.mixed_prefill, copy)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
