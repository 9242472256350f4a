"""`bench scaling`'s outputs: the table (stdout and scaling.md), scaling.csv, scaling.png and scaling.json."""

from __future__ import annotations

import csv
import json
import os

COLUMNS = ("config", "replicas", "tp", "workload", "routing", "kv_blocks", "output_tok_s", "speedup", "efficiency",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "cache_hit_rate", "control_plane_share", "client_cpu_max",
           "outputs_match_first")


def rows(runs: list[dict]) -> list[dict]:
    return [dict(
        config=r["config"], replicas=r["replicas"], tp=r["tp"], workload=r["workload"], routing=r["routing"],
        kv_blocks="" if r.get("kv_cap") is None else r["kv_cap"],
        output_tok_s=round(r["output_tok_s"], 1), speedup=round(r["speedup"], 3), efficiency=round(r["efficiency"], 3),
        ttft_p50_ms=_ms(r["ttft"], "p50"), ttft_p99_ms=_ms(r["ttft"], "p99"),
        tpot_p50_ms=_ms(r["tpot"], "p50"), tpot_p99_ms=_ms(r["tpot"], "p99"),
        cache_hit_rate=round(r["cache_hit_rate"], 3) if "cache_hit_rate" in r else "",
        control_plane_share="" if r["control_plane_share"] is None else round(r["control_plane_share"], 3),
        client_cpu_max=round(r["client_cpu_max"], 3),
        outputs_match_first="" if r["outputs_match_first"] is None else r["outputs_match_first"],
    ) for r in runs]


def _ms(stats, key: str):
    return "" if stats is None else round(getattr(stats, key), 1)


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in table]
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("the scaling plot needs matplotlib: pip install 'shardserve[bench]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, workload in zip(axes, ("offline", "shared-prefix")):
        points = [r for r in table if r["workload"] == workload]
        multi = len({r["routing"] for r in points if r["replicas"] > 1}) > 1
        labels = [r["config"] + (f"\n{r['routing']}" if multi and r["replicas"] > 1 else "")
                  + (f"\n{r['kv_blocks']} blocks" if r.get("kv_blocks") not in (None, "") else "") for r in points]
        ax.bar(range(len(points)), [r["output_tok_s"] for r in points], color="#4a7ab5")
        ax.set_xticks(range(len(points)), labels, fontsize=8)
        for i, r in enumerate(points):
            ax.annotate(f"{r['speedup']:.2f}x", (i, r["output_tok_s"]), ha="center", fontsize=8,
                        textcoords="offset points", xytext=(0, 3))
        ax.set_title(workload)
        ax.set_xlabel("replicas x TP")
        ax.set_ylabel("output tokens/s")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(runs: list[dict], records: list[dict], out_dir: str | None, title: str, quiet: bool = False) -> None:
    table = rows(runs)
    text = markdown(table)
    if not quiet:
        print(text, flush=True)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "scaling.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "scaling.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    with open(os.path.join(out_dir, "scaling.json"), "w") as f:
        json.dump(records, f, indent=2)
        f.write("\n")
    plot(table, os.path.join(out_dir, "scaling.png"), title)
