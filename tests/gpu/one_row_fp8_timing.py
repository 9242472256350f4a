"""Times the one-row layer's GEMVs with e4m3 weights (quantization="fp8", kernels/gemv.py) against the bf16 ones
and against cuBLAS's FP8 product at one row, at Llama-3-8B's and
Qwen3-0.6B's shapes, on one GPU:

    python tests/gpu/one_row_fp8_timing.py OUT.json [MODEL ...]    # on a CUDA host, from the project root

Each figure is one CUDA graph of REPEATS calls cycling over COPIES weight copies (more bytes than the L2 holds),
replayed and timed with CUDA events (one_row_timing.us), with the weight's read rate in
TB/s beside it. Not a test (no timing asserts).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from one_row_timing import COPIES, REPEATS, us  # (tests/gpu on the path: run as a script from the project root)

from shardserve.kernels import gemv as gemv_module
from shardserve.kernels.fp8_linear import fp8_linear, quantize_rows, quantize_weight
from shardserve.kernels.gemv import gemv_fused

MODELS = {"llama8b": (4096, 6144, 14336, 4096), "qwen3": (1024, 4096, 3072, 2048)}  # hidden, qkv, inter, o_proj K
SETTINGS = [(8, 1024, 4), (16, 1024, 4), (8, 2048, 4), (4, 2048, 4), (16, 512, 4)]
# (read e4m3 VEC at a time, products summed GROUP at a time in the lane): gemv.py's FP8_VEC and FP8_GROUP
VARIANTS = [(0, 0), (8, 0), (8, 8), (8, 16)]
if os.environ.get("QUICK"):  # QUICK=1: fewer kernels to compile
    SETTINGS, VARIANTS = [(8, 1024, 4), (8, 2048, 4)], [(8, 0), (8, 8)]


def main(out_path: str, models: list[str]) -> None:
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "repeats": REPEATS, "copies": COPIES, "models": {}}
    for model, (hidden, qkv_n, inter, o_k) in MODELS.items():
        if models and model not in models:
            continue
        bf = dict(dtype=torch.bfloat16, device="cuda")
        shapes = {"qkv": (qkv_n, hidden), "o_proj": (hidden, o_k), "gate_up": (2 * inter, hidden),
                  "down": (hidden, inter)}
        g = torch.rand(hidden, **bf) + 0.5
        h = torch.randn(1, hidden, **bf)
        inputs = {"qkv": h, "gate_up": h, "o_proj": torch.randn(1, o_k, **bf), "down": torch.randn(1, 2 * inter, **bf)}
        times = {}
        for proj, (n, k) in shapes.items():
            ws = [torch.randn(n, k, **bf) * 0.02 for _ in range(COPIES)]
            qs = [quantize_weight(w) for w in ws]
            x = inputs[proj]
            reading = {"qkv": dict(norm=(g, 1e-5)), "gate_up": dict(norm=(g, 1e-5)), "o_proj": dict(residual=h),
                       "down": dict(silu=True, residual=h)}[proj]
            default = dict(block_n=4, block_k=2048) if proj == "o_proj" else {}
            t = us(lambda i: gemv_fused(x, ws[i], **reading, **default))
            times[f"{proj}: bf16 fused (default launch)"] = (round(t, 2), round(n * k * 2 / t / 1e6, 2))
            for vec, group in VARIANTS:
                gemv_module.FP8_VEC, gemv_module.FP8_GROUP = vec, group
                for bn, bk, warps in SETTINGS:
                    launch = dict(block_n=bn, block_k=bk, warps=warps)
                    t = us(lambda i: gemv_fused(x, qs[i][0], **reading, **launch, weight_scale=qs[i][1]))
                    name = f"{proj}: fp8 fused {bn}x{bk}x{warps} vec {vec} group {group}"
                    times[name] = (round(t, 2), round(n * k / t / 1e6, 2))
            plain = x[:, :k].contiguous()
            t = us(lambda i: fp8_linear(plain, qs[i][0], qs[i][1]))
            times[f"{proj}: quantize_rows + cuBLAS FP8 (no norm/SiLU)"] = (round(t, 2), round(n * k / t / 1e6, 2))
            xq = quantize_rows(plain)
            t = us(lambda i: torch._scaled_mm(xq[0], qs[i][0].t(), scale_a=xq[1], scale_b=qs[i][1],
                                              out_dtype=torch.bfloat16, use_fast_accum=True))
            times[f"{proj}: cuBLAS FP8 alone"] = (round(t, 2), round(n * k / t / 1e6, 2))
            ws = qs = None  # (the copies freed before the next projection)
        result["models"][model] = times
        for name, (t, rate) in times.items():
            print(f"{model} {name}: {t:.2f} us, {rate:.2f} TB/s")
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "one_row_fp8_timing.json", sys.argv[2:])
