"""Decode-batch projections on the GPU: cuBLAS against the split-K GEMM (kernels/gemm_splitk.py), alone and in a
decoder layer's chain.

Per batch M and projection of the model (TP=1 shapes): cuBLAS (F.linear) and splitk_gemm at each launch setting in
CONFIGS, us a launch and the weight's read rate against the copy rate. Then the layer's launches around attention
as the decoder runs them (add + RMSNorm, qkv, o_proj, add + RMSNorm, gate_up, SiLU-and-mul, down) with cuBLAS and
with the split-K GEMM at each projection's best setting, with and without PDL.

Timing as bench/attention_rates.py: CUDA graphs replayed, over one weight copy per layer of the model (so every
launch reads its weight from device memory, as a decode step does).

    python -m shardserve.bench.gemm_rates --model qwen3-0.6b --rows 32,64,128,256 --json-out F
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
CONFIGS = [(64, 32, 128, 1, 4, 3), (64, 32, 128, 2, 4, 3), (64, 32, 128, 4, 4, 3), (64, 32, 256, 4, 4, 3),
           (64, 64, 128, 2, 4, 3), (64, 64, 128, 4, 4, 3), (64, 32, 128, 8, 4, 3), (128, 32, 128, 4, 4, 3),
           (128, 64, 128, 2, 8, 3), (64, 16, 256, 4, 4, 3)]


def _model_dims(model: str) -> tuple[int, int, int, int, int]:
    """(hidden, q width, kv width, intermediate, layers) at TP=1."""
    from transformers import AutoConfig

    from shardserve.models import resolve_model
    from shardserve.worker.models.decoder import head_dim_of

    cfg = AutoConfig.from_pretrained(resolve_model(model, "dummy").model_dir)
    d = head_dim_of(cfg)
    return (cfg.hidden_size, cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size,
            cfg.num_hidden_layers)


def gemm_rates(model: str, rows: list[int], copy_bytes_per_s: float, configs=CONFIGS, device: str = "cuda") -> dict:
    from shardserve.bench.attention_rates import graph_ms
    from shardserve.kernels.activation import silu_and_mul
    from shardserve.kernels.gemm_splitk import splitk_gemm
    from shardserve.kernels.rmsnorm import add_rms_norm

    hidden, q, kv, inter, layers = _model_dims(model)
    dt, dev = (torch.bfloat16, device) if device == "cuda" else (torch.float32, device)  # CPU: a dry run (tests)
    shapes = {"qkv": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    weights = {name: [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(layers)]
               for name, (n, k) in shapes.items()}
    ln = [torch.rand(hidden, dtype=dt, device=dev) + 0.5 for _ in range(layers)]
    out = {"model": model, "copy_bytes_per_s": copy_bytes_per_s, "rows": [], "chains": []}
    for m in rows:
        inputs = {"qkv": torch.randn(m, hidden, dtype=dt, device=dev), "o_proj": torch.randn(m, q, dtype=dt, device=dev),
                  "gate_up": torch.randn(m, hidden, dtype=dt, device=dev),
                  "down": torch.randn(m, inter, dtype=dt, device=dev)}
        best = {}
        for name, (n, k) in shapes.items():
            x, ws, w_bytes = inputs[name], weights[name], n * k * 2
            cublas = graph_ms([lambda i=i: F.linear(x, ws[i]) for i in range(layers)], launches=layers) * 1e3
            row = {"rows": m, "projection": name, "n": n, "k": k, "cublas_us": cublas,
                   "cublas_fraction_of_copy_rate": w_bytes / (cublas / 1e6) / copy_bytes_per_s, "configs": []}
            for cfg in configs:
                try:
                    us = graph_ms([lambda i=i: splitk_gemm(x, ws[i], config=cfg) for i in range(layers)],
                                  launches=layers) * 1e3
                except Exception as exc:  # a setting the compiler refuses (shared memory): recorded, skipped
                    row["configs"].append({"config": cfg, "error": repr(exc)[:200]})
                    continue
                row["configs"].append({"config": cfg, "us": us,
                                       "fraction_of_copy_rate": w_bytes / (us / 1e6) / copy_bytes_per_s})
            top = min((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
            best[name] = top["config"]
            row.update(best_config=top["config"], best_us=top["us"])
            print(f"M={m} {name} {n}x{k}: cuBLAS {cublas:.2f} us ({row['cublas_fraction_of_copy_rate']:.0%}), split-K "
                  f"{top['us']:.2f} us ({top['fraction_of_copy_rate']:.0%}) at {top['config']}", flush=True)
            out["rows"].append(row)

        h, a = inputs["qkv"], inputs["o_proj"]

        def layer(i, mm):  # the launches around attention (attention's output: a)
            x, res = add_rms_norm(h, h, ln[i], 1e-6)
            mm(x, weights["qkv"][i], "qkv")
            o = mm(a, weights["o_proj"][i], "o_proj")
            x, res = add_rms_norm(o, res, ln[i], 1e-6)
            return mm(silu_and_mul(mm(x, weights["gate_up"][i], "gate_up")), weights["down"][i], "down")

        variants = {"cublas_us": lambda x, w, name: F.linear(x, w),
                    "split_k_us": lambda x, w, name: splitk_gemm(x, w, config=best[name]),
                    "split_k_no_pdl_us": lambda x, w, name: splitk_gemm(x, w, config=best[name], pdl=False),
                    "split_k_o_down_only_us": lambda x, w, name: (splitk_gemm(x, w, config=best[name])
                                                                  if name in ("o_proj", "down") else F.linear(x, w))}
        chain = {"rows": m, "configs": best}
        for key, mm in variants.items():
            chain[key] = graph_ms([lambda i=i, mm=mm: layer(i, mm) for i in range(layers)], launches=layers) * 1e3
        print(f"M={m} layer chain (attention left out): cuBLAS {chain['cublas_us']:.2f} us, split-K "
              f"{chain['split_k_us']:.2f} us (without PDL {chain['split_k_no_pdl_us']:.2f}; for o_proj and down only "
              f"{chain['split_k_o_down_only_us']:.2f})", flush=True)
        out["chains"].append(chain)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from shardserve.bench.roofline import measure_rates

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", default="32,64,128,192,256", help="batch sizes M, comma-separated")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    copy = measure_rates("cuda", matmul_n=1024).copy_bytes_per_s
    report = gemm_rates(args.model, rows, copy)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
