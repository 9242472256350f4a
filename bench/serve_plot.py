"""`bench serve --plot out.png`: latency against throughput over a rate sweep, one line per API (gRPC, HTTP)."""

from __future__ import annotations


def plot_sweep(records: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'shardserve[bench]'") from None
    panels = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "end-to-end latency (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for api, style in (("grpc", "o-"), ("http", "s--")):
        points = [r for r in records if r["notes"]["api"] == api]  # in sweep order: rising load
        if not points:
            continue
        x = [r["output_tokens_per_s"] for r in points]
        for ax, (key, label) in zip(axes, panels):
            ax.plot(x, [r[key]["p50"] for r in points], style, label=f"{api} p50")
            ax.plot(x, [r[key]["p99"] for r in points], style, alpha=0.4, label=f"{api} p99")
            for r, xi in zip(points, x):
                ax.annotate(point_label(r["workload"]), (xi, r[key]["p50"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def point_label(workload: dict) -> str:
    rate, concurrency = workload["request_rate"], workload.get("max_concurrency")
    label = f"{rate:g}/s" if isinstance(rate, (int, float)) else str(rate)
    return f"{label}, c={concurrency}" if concurrency else label
