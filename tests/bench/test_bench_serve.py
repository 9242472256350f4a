"""`shardserve bench serve` end to end on CPU: it starts `shardserve serve` (a tiny random Llama without a tokenizer,
so prompts go as token ids) with the HTTP gateway (a `shardserve gateway --workers 2` of its own), sweeps two request rates through gRPC and through the gateway,
and writes one record per run and the plot. Checks the records' fields and their consistency, never timings."""

from __future__ import annotations

import json

import pytest

from shardserve.cli.main import main as cli

SCHEMA = ("benchmark", "model", "load_format", "device", "num_gpus", "tp", "replicas", "workload",
          "output_tokens_per_s", "total_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "command", "date",
          "commit", "notes")


def test_bench_serve_sweeps_rates_through_grpc_and_the_gateway_and_writes_consistent_records(tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert cli(["bench", "serve", "--model", model, "--device", "cpu", "--load-format", "dummy", "--max-model-len",
                "128", "--num-kv-blocks", "64", "--api", "both", "--request-rates", "20,inf", "--num-prompts", "6",
                "--input-len", "8-24", "--output-len", "3-8", "--warmup", "1", "--slo-ttft-ms", "60000",
                "--gateway-workers", "2",
                "--json-out", str(out), "--plot", str(png)]) == 0
    records = json.loads(out.read_text())
    assert [(r["notes"]["api"], r["workload"]["request_rate"]) for r in records] == [
        ("grpc", 20.0), ("grpc", "inf"), ("http", 20.0), ("http", "inf")]
    for r in records:
        assert not [f for f in SCHEMA if f not in r], r
        n = r["notes"]
        assert r["benchmark"] == "serve" and r["tp"] == 1 and r["workload"]["prompt_format"] == "token-ids"
        assert n["completed"] == 6 and n["failed"] == 0 and not n["errors"]
        assert n["gateway_workers"] == (2 if n["api"] == "http" else None)
        assert n["goodput"] == pytest.approx(n["request_throughput"])  # a one-minute TTFT SLO: every request meets it
        assert r["output_tokens_per_s"] == pytest.approx(n["total_output_tokens"] / n["duration_s"])
        assert r["total_tokens_per_s"] > r["output_tokens_per_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 <= r[key]["p50"] <= r[key]["p99"], (key, r[key])
        assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    # the same prompts and lengths (ignore_eos) whatever the API and the rate
    assert len({(r["notes"]["total_input_tokens"], r["notes"]["total_output_tokens"]) for r in records}) == 1
    assert png.stat().st_size > 0
