"""Times the one-row decoder layer's GEMVs (kernels/gemv.py: gemv_fused) against the kernels they replace, at
Llama-3-8B's and Qwen3-0.6B's shapes, batch 1, bf16, on one GPU:

    python tests/gpu/one_row_timing.py OUT.json     # on a CUDA host, from the project root

Each figure is one CUDA graph of REPEATS calls cycling over COPIES weight copies (more bytes than the L2 holds, as
a model's layers are), replayed and timed with CUDA events: the median replay divided by REPEATS (the records at
d548168 took the fastest of 5). Not a test (no timing asserts).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from shardserve.bench.attention_cases import graph_ms
from shardserve.kernels import gemv as gemv_module
from shardserve.kernels.silu_and_mul import silu_and_mul
from shardserve.kernels.gemv import gemv, gemv_fused
from shardserve.kernels.rmsnorm import add_rms_norm

REPEATS, COPIES = 32, 4
MODELS = {"llama8b": (4096, 6144, 14336), "qwen3": (1024, 4096, 3072)}  # hidden, qkv width, intermediate
SETTINGS = [(8, 1024, 4), (16, 1024, 4), (4, 1024, 4), (4, 2048, 4), (2, 4096, 4), (4, 4096, 8), (8, 2048, 8)]


def us(fn) -> float:
    """Device us per call of fn(i), i cycling over the COPIES weight copies, REPEATS calls in one CUDA graph
    (shardserve.bench.attention_rates.graph_ms: the median of its replays)."""
    return graph_ms([lambda i=i: fn(i) for i in range(COPIES)], launches=REPEATS) * 1e3


def main(out_path: str) -> None:
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "repeats": REPEATS, "copies": COPIES, "models": {}}
    for model, (hidden, qkv_n, inter) in MODELS.items():
        bf = dict(dtype=torch.bfloat16, device="cuda")
        ws = {name: [torch.randn(n, k, **bf) * 0.02 for _ in range(COPIES)]
              for name, (n, k) in {"qkv": (qkv_n, hidden), "o_proj": (hidden, hidden if model == "llama8b" else 2048),
                                   "gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items()}
        g = torch.rand(hidden, **bf) + 0.5
        h, res = torch.randn(1, hidden, **bf), torch.randn(1, hidden, **bf)
        attn = torch.randn(1, ws["o_proj"][0].shape[1], **bf)
        gu = torch.randn(1, 2 * inter, **bf)

        times = {}
        gemv_module.FLAT = "0"  # the reduced sums (FLAT "0") for the launch settings compared below
        for proj in ("qkv", "gate_up"):
            w = ws[proj]
            times[f"{proj}: add_rms_norm + gemv"] = us(
                lambda i: gemv(add_rms_norm(h, res, g, 1e-5)[0], w[i], 8, 1024, 4))
            times[f"{proj}: gemv alone"] = us(lambda i: gemv(h, w[i], 8, 1024, 4))
            for bn, bk, warps in SETTINGS:
                times[f"{proj}: fused norm {bn}x{bk}x{warps}"] = us(
                    lambda i: gemv_fused(h, w[i], norm=(g, 1e-5), block_n=bn, block_k=bk, warps=warps))
        w = ws["o_proj"]
        times["o_proj: gemv"] = us(lambda i: gemv(attn, w[i], 8, 1024, 4))
        for bn, bk, warps in SETTINGS:
            times[f"o_proj: fused residual {bn}x{bk}x{warps}"] = us(
                lambda i: gemv_fused(attn, w[i], residual=h, block_n=bn, block_k=bk, warps=warps))
        w = ws["down"]
        times["down: silu + cuBLAS"] = us(lambda i: F.linear(silu_and_mul(gu), w[i]))
        times["down: silu + gemv"] = us(lambda i: gemv(silu_and_mul(gu), w[i], 8, 1024, 4))
        act = torch.randn(1, inter, **bf)
        times["down: cuBLAS alone"] = us(lambda i: F.linear(act, w[i]))
        for bn, bk, warps in SETTINGS:
            times[f"down: fused silu residual {bn}x{bk}x{warps}"] = us(
                lambda i: gemv_fused(gu, w[i], silu=True, residual=h, block_n=bn, block_k=bk, warps=warps))
        gemv_module.FLAT = "1"  # the lane-by-lane sums (FLAT "1")
        times["o_proj: gemv flat 8x1024x4"] = us(lambda i: gemv(attn, ws["o_proj"][i], 8, 1024, 4))
        for proj, reading in (("qkv", "norm"), ("gate_up", "norm"), ("o_proj", "residual"), ("down", "silu")):
            w = ws[proj]
            for bn, bk, warps in SETTINGS:
                launch = dict(block_n=bn, block_k=bk, warps=warps)
                fused = {"norm": lambda i: gemv_fused(h, w[i], norm=(g, 1e-5), **launch),
                         "residual": lambda i: gemv_fused(attn, w[i], residual=h, **launch),
                         "silu": lambda i: gemv_fused(gu, w[i], silu=True, residual=h, **launch)}[reading]
                times[f"{proj}: fused {reading} flat {bn}x{bk}x{warps}"] = us(fused)
        gemv_module.FLAT = "auto"
        ws.clear()
        vocab = 128256 if model == "llama8b" else 151936  # the LM head at batch 1 (layers/linear.py: matmul)
        heads = [torch.randn(vocab, hidden, **bf) * 0.02 for _ in range(COPIES)]
        times["lm_head: cuBLAS"] = us(lambda i: F.linear(h, heads[i]))
        for flat in ("0", "1"):
            gemv_module.FLAT = flat
            name = f"lm_head: gemv{' flat' if flat == '1' else ''} 8x1024x4"
            times[name] = us(lambda i: gemv(h, heads[i], 8, 1024, 4))
        gemv_module.FLAT = "auto"
        heads.clear()
        result["models"][model] = times
        for name, t in times.items():
            print(f"{model} {name}: {t:.2f} us")
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "one_row_timing.json")
