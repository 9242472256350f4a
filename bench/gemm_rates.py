"""Decode-batch projections on the GPU: cuBLAS against kernels/gemm_rows.py, alone and as a decoder layer's chain.

Per batch M and projection of the model (TP=1 shapes): cuBLAS (F.linear) and gemm_rows at each launch setting in
CONFIGS with the projection's fused reads (qkv and gate_up through the norm, down through SiLU, o_proj and down
adding the residual), us a launch and the weight's read rate against the copy rate. Then the layer's projections
as the decoder runs them today (add + RMSNorm, qkv, o_proj, add + RMSNorm, gate_up, SiLU-and-mul, down: seven
launches, attention left out) against four gemm_rows launches at the best settings, with and without PDL.

Timing as bench/attention_rates.py: CUDA graphs replayed, over one weight copy per layer of the model (so every
launch reads its weight from device memory, as a decode step does).

    python -m shardserve.bench.gemm_rates --model qwen3-0.6b --rows 32,64,128,256 --json-out F
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 128, 4, 3),
           (64, 32, 256, 4, 3), (128, 64, 64, 4, 3), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (32, 64, 128, 4, 4)]


def _model_dims(model: str) -> tuple[int, int, int, int, int]:
    """(hidden, q width, kv width, intermediate, layers) at TP=1."""
    from transformers import AutoConfig

    from shardserve.models import resolve_model
    from shardserve.worker.models.decoder import head_dim_of

    cfg = AutoConfig.from_pretrained(resolve_model(model, "dummy").model_dir)
    d = head_dim_of(cfg)
    return (cfg.hidden_size, cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size,
            cfg.num_hidden_layers)


def _projections(hidden: int, q: int, kv: int, inter: int) -> dict[str, tuple[int, int, str]]:
    """name -> (N, K, fused reads)."""
    return {"qkv": (q + 2 * kv, hidden, "norm"), "o_proj": (hidden, q, "residual"),
            "gate_up": (2 * inter, hidden, "norm+silu_mul"), "down": (hidden, inter, "residual")}


def gemm_rates(model: str, rows: list[int], copy_bytes_per_s: float, configs=CONFIGS) -> dict:
    from shardserve.bench.attention_rates import graph_ms
    from shardserve.kernels.activation import silu_and_mul
    from shardserve.kernels.gemm_rows import gemm_rows
    from shardserve.kernels.rmsnorm import add_rms_norm

    hidden, q, kv, inter, layers = _model_dims(model)
    dt, dev = torch.bfloat16, "cuda"
    projections = _projections(hidden, q, kv, inter)
    weights = {name: [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(layers)]
               for name, (n, k, _) in projections.items()}
    ln = [torch.rand(hidden, dtype=dt, device=dev) + 0.5 for _ in range(layers)]
    out = {"model": model, "copy_bytes_per_s": copy_bytes_per_s, "rows": []}
    for m in rows:
        h = torch.randn(m, hidden, dtype=dt, device=dev)
        a = torch.randn(m, q, dtype=dt, device=dev)
        act = torch.randn(m, inter, dtype=dt, device=dev)
        best: dict[str, tuple] = {}
        for name, (n, k, fused) in projections.items():
            x = {"qkv": h, "o_proj": a, "gate_up": h, "down": act}[name]
            ws = weights[name]
            kw = {"norm": lambda i: {"norm": (ln[i], 1e-6)}, "residual": lambda i: {"residual": h},
                  "norm+silu_mul": lambda i: {"norm": (ln[i], 1e-6), "silu_mul": True}}[fused]
            w_bytes = n * k * 2
            cublas = graph_ms([lambda i=i: F.linear(x, ws[i]) for i in range(layers)], launches=layers) * 1e3
            row = {"rows": m, "projection": name, "n": n, "k": k, "fused": fused, "cublas_us": cublas,
                   "cublas_fraction_of_copy_rate": w_bytes / (cublas / 1e6) / copy_bytes_per_s, "configs": []}
            for cfg in configs:
                try:
                    us = graph_ms([lambda i=i: gemm_rows(x, ws[i], config=cfg, **kw(i)) for i in range(layers)],
                                  launches=layers) * 1e3
                except Exception as exc:  # a setting the compiler refuses (shared memory): recorded, skipped
                    row["configs"].append({"config": cfg, "error": repr(exc)[:200]})
                    continue
                row["configs"].append({"config": cfg, "us": us,
                                       "fraction_of_copy_rate": w_bytes / (us / 1e6) / copy_bytes_per_s})
            timed = [c for c in row["configs"] if "us" in c]
            top = min(timed, key=lambda c: c["us"])
            best[name] = top["config"]
            row.update(best_config=top["config"], best_us=top["us"])
            print(f"M={m} {name} {n}x{k} ({fused}): cuBLAS {cublas:.2f} us ({row['cublas_fraction_of_copy_rate']:.0%}),"
                  f" gemm_rows best {top['us']:.2f} us ({top['fraction_of_copy_rate']:.0%}) at {top['config']}",
                  flush=True)
            out["rows"].append(row)

        def today(i):  # the layer's launches around attention as decoder.py runs them now (attention's output: a)
            x, res = add_rms_norm(h, h, ln[i], 1e-6)
            F.linear(x, weights["qkv"][i])
            o = F.linear(a, weights["o_proj"][i])
            x, res = add_rms_norm(o, res, ln[i], 1e-6)
            return F.linear(silu_and_mul(F.linear(x, weights["gate_up"][i])), weights["down"][i])

        def fused(i, pdl=True, configs=best):
            gemm_rows(h, weights["qkv"][i], norm=(ln[i], 1e-6), config=configs["qkv"], pdl=pdl)
            r = gemm_rows(a, weights["o_proj"][i], residual=h, config=configs["o_proj"], pdl=pdl)
            g = gemm_rows(r, weights["gate_up"][i], norm=(ln[i], 1e-6), silu_mul=True, config=configs["gate_up"],
                          pdl=pdl)
            return gemm_rows(g, weights["down"][i], residual=r, config=configs["down"], pdl=pdl)

        chain = {"rows": m, "configs": best}
        for key, fn in (("today_us", today), ("fused_us", fused), ("fused_no_pdl_us", lambda i: fused(i, False))):
            chain[key] = graph_ms([lambda i=i: fn(i) for i in range(layers)], launches=layers) * 1e3
        # the same settings for every projection (what SHARDSERVE_GEMM_ROWS_CONFIG sets): each, through the chain
        chain["uniform_us"] = {}
        for cfg in configs:
            try:
                chain["uniform_us"][",".join(map(str, cfg))] = graph_ms(
                    [lambda i=i: fused(i, configs=dict.fromkeys(projections, cfg)) for i in range(layers)],
                    launches=layers) * 1e3
            except Exception:  # refused by the compiler: left out
                pass
        uniform = min(chain["uniform_us"].items(), key=lambda kv: kv[1])
        print(f"M={m} layer chain (attention left out): today {chain['today_us']:.2f} us, fused "
              f"{chain['fused_us']:.2f} us, fused without PDL {chain['fused_no_pdl_us']:.2f} us, one setting for "
              f"all: {uniform[1]:.2f} us at {uniform[0]}", flush=True)
        out.setdefault("chains", []).append(chain)
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
    copy = measure_rates("cuda", matmul_n=1024).copy_bytes_per_s
    report = gemm_rates(args.model, [int(r) for r in args.rows.split(",")], copy)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
