"""Times decode-size matmuls on one GPU: torch's F.linear (cuBLAS) against the Triton GEMV (kernels/gemv.py) at
batch 1 (and 2, 4), for Llama-3-8B's and Qwen3-0.6B's projections and a launch-setting sweep; and the greedy
argmax over a 128,256-entry row, torch's against a two-stage one.

    python tests/gpu/gemv_timing.py OUT.json     # on a CUDA host, from the project root

Each time is one CUDA graph of REPEATS back-to-back calls, replayed and timed with CUDA events (no launch gaps in
the figure), divided by REPEATS. Not a test (no timing asserts); docs/performance.md records its figures.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F

from shardserve.kernels.gemv import gemv

REPEATS = 50
SHAPES = {  # name: (N, K)
    "llama8b.qkv": (6144, 4096), "llama8b.o_proj": (4096, 4096), "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336), "qwen3.qkv": (4096, 1024), "qwen3.o_proj": (1024, 2048),
    "qwen3.gate_up": (6144, 1024), "qwen3.down": (1024, 3072),
}
SETTINGS = [(bn, bk, warps, split)  # block_n, block_k, warps, split-K; tiles of at most 16k weights (registers)
            for bn, bk, warps, split in itertools.product([8, 16, 32], [256, 512, 1024], [4, 8], [1, 2, 4])
            if bn * bk <= 16384]


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / REPEATS)
    return best


def copy_rate() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms / 1e3)


def main(out_path: str) -> None:
    torch.manual_seed(0)
    rate = copy_rate()
    result = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": rate, "shapes": {}, "argmax": {}}
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(4, k, dtype=torch.bfloat16, device="cuda")
        entry = {"n": n, "k": k}
        for m in (1, 2, 4):
            xm = x[:m]
            ref = F.linear(xm, w)
            t_torch = graph_ms(lambda: F.linear(xm, w))
            best = None
            sweep = []
            for bn, bk, warps, split in SETTINGS if m == 1 else [best_setting]:
                try:
                    out = gemv(xm, w, bn, bk, warps, split)
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = graph_ms(lambda: gemv(xm, w, bn, bk, warps, split))
                except Exception as exc:  # a setting that does not compile here
                    sweep.append({"setting": [bn, bk, warps, split], "error": str(exc)[:200]})
                    continue
                sweep.append({"setting": [bn, bk, warps, split], "ms": ms, "max_abs_err": err})
                if best is None or ms < best[0]:
                    best = (ms, [bn, bk, warps, split], err)
            if m == 1:
                best_setting = tuple(best[1])
                entry["sweep"] = sweep
            weight_bytes = n * k * 2
            entry[f"m{m}"] = {"torch_ms": t_torch, "torch_tb_s": weight_bytes / t_torch / 1e9,
                              "gemv_ms": best[0], "gemv_tb_s": weight_bytes / best[0] / 1e9,
                              "gemv_setting": best[1], "gemv_max_abs_err": best[2],
                              "ref_max_abs": ref.float().abs().max().item()}
            print(f"{name} m={m}: torch {t_torch * 1e3:.1f} us ({weight_bytes / t_torch / 1e9:.2f} TB/s), "
                  f"gemv {best[0] * 1e3:.1f} us ({weight_bytes / best[0] / 1e9:.2f} TB/s) {best[1]} err {best[2]:.3g}")
        result["shapes"][name] = entry
        del w
    logits = torch.randn(1, 128256, dtype=torch.bfloat16, device="cuda")
    chunks = 64
    width = -(-128256 // chunks)
    padded = torch.full((1, chunks * width), float("-inf"), dtype=torch.bfloat16, device="cuda")

    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)

    def two_stage():  # a max per chunk (64 blocks), then the argmax of the 64 maxima: no host sync
        padded[:, :128256].copy_(logits)
        vals, idx = padded.view(chunks, width).max(dim=1)
        best = vals.argmax(dim=0, keepdim=True)
        return best * width + idx.gather(0, best)
    assert int(two_stage()) == int(torch.argmax(logits, dim=1))
    result["argmax"] = {"torch_ms": graph_ms(lambda: torch.argmax(logits, dim=1)), "two_stage_ms": graph_ms(two_stage)}
    print("argmax", result["argmax"])
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
