"""`shardserve bench scaling` end to end on CPU: a tiny random Llama, 1x1 / 2x1 / 1x2 on a Ray started by the
command (loopback), each configuration's greedy tokens equal to 1x1's, the shared-prefix workload hitting the
replicas' caches, and every output file written (JSON records of the common schema, CSV, markdown, PNG). No timing
asserts: CPU numbers mean nothing here. Also the sweep's shape. The routing benchmark's router-only part, briefly."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from shardserve.bench.scaling import sweep

REPO = Path(__file__).resolve().parents[2]
SCHEMA = ("benchmark", "model", "load_format", "device", "num_gpus", "tp", "replicas", "workload",
          "output_tokens_per_s", "speedup_vs_1", "ttft_ms", "tpot_ms", "command", "date", "commit")


def test_the_sweep_fits_the_units_and_goes_1x1_2x1_1x2_4x1_2x2():
    assert sweep(4, [1, 2, 4, 8]) == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]
    assert sweep(1, [1, 2]) == [(1, 1)]


def test_scaling_runs_every_config_with_equal_outputs_and_writes_every_file(tiny_model, tmp_path):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    out = tmp_path / "scaling"
    env = dict(os.environ, RAY_ADDRESS="", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-m", "shardserve.cli.main", "bench", "scaling", "--model", model, "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64", "--ray-address", "local",
         "--configs", "1x1,2x1,1x2", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
         "--prefixes", "2", "--prefix-len", "48", "--per-prefix", "4", "--suffix-len", "4",
         "--prefix-output-len", "3", "--concurrency", "2", "--routing", "cache-aware,round-robin",
         "--shared-configs", "1x1,2x1", "--shared-kv-blocks", "40", "--client-procs", "2", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=str(REPO),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    records = json.loads((out / "scaling.json").read_text())
    assert [(r["replicas"], r["tp"], r["workload"]["kind"], r["workload"]["routing"],
             r["workload"].get("kv_blocks_per_replica")) for r in records] == [
        (1, 1, "offline", "cache-aware", None), (1, 1, "shared-prefix", "cache-aware", [64]),
        (1, 1, "shared-prefix", "cache-aware", [40]), (2, 1, "offline", "cache-aware", None),
        (2, 1, "shared-prefix", "cache-aware", [40, 40]), (2, 1, "shared-prefix", "round-robin", [40, 40]),
        (1, 2, "offline", "cache-aware", None)]  # one replica's whole cache, then capped for the A/B
    for r in records:
        assert all(f in r for f in SCHEMA) and r["benchmark"] == "scaling" and r["speedup_vs_1"] > 0
        assert 0 < r["control_plane_share"] < 1 and r["notes"]["client_procs"] == 2
    offline = [r for r in records if r["workload"]["kind"] == "offline"]
    assert all(r["notes"]["outputs_match_first"] is True for r in offline)
    # offline answers come in one message each (final_only): no first-token time; shared-prefix ones stream
    assert all(r["workload"]["answers"] == "final-only" and r["ttft_ms"] is None for r in offline)
    shared = [r for r in records if r["workload"]["kind"] == "shared-prefix"]
    # prefixes are reused (how much depends on timing: two in flight may both miss)
    assert all(r["notes"]["cache_hit_rate"] > 0 for r in shared if r["workload"]["routing"] == "cache-aware")
    assert records[0]["speedup_vs_1"] == 1.0
    table = list(csv.DictReader((out / "scaling.csv").open()))
    assert [row["config"] for row in table] == ["1x1", "1x1", "1x1", "2x1", "2x1", "2x1", "1x2"]
    assert (out / "scaling.png").stat().st_size > 0 and "| config |" in (out / "scaling.md").read_text()
    assert "scaling" in run.stderr and "44/44" in run.stderr  # the progress bar reached the end: 3 x 4 + 4 x 8


def test_routing_bench_router_part_runs_for_8_and_64_replicas(capsys):
    from shardserve.cli.main import main as cli

    assert cli(["bench", "routing", "--replicas", "8,64", "--duration", "0", "--route-requests", "300",
                "--input-len", "256"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("router")]
    assert len(lines) == 2 and "replicas= 64" in lines[1]
