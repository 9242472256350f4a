"""`shardserve serve --dry-run`: the placement report of a pipeline x tensor-parallel replica, from config.json
alone, checked against the model's own parameter count, and the CLI that prints it (no Ray, nothing loaded)."""

from __future__ import annotations


from shardserve.launch.stage_report import stage_figures
from shardserve.settings.resolve import build_engine_config
from shardserve.worker.models.hf_config import read_hf_config
from tests.test_cli_errors import assert_one_line_error, shardserve

GIB = 1 << 30


def test_llama_405b_over_two_stages_of_eight_holds_its_parameters_once_and_its_kv_per_layer():
    config = build_engine_config(model="llama-3-405b", device="cuda", dtype="bfloat16", tensor_parallel_size=8,
                                 pipeline_parallel_size=2)
    hf = read_hf_config(config.model)
    stages = stage_figures(config, hf, 80.0)
    assert [(s.first_layer, s.end_layer, list(s.ranks)) for s in stages] == [(0, 63, list(range(8))),
                                                                            (63, 126, list(range(8, 16)))]
    params = 405.85e9  # Llama 3.1 405B: every weight over 16 GPUs (embedding and LM head once each)
    total = sum(s.weight_bytes for s in stages) * 8
    assert abs(total / 2 - params) / params < 0.005
    # one KV head of 128 dims a GPU (8 KV heads / TP 8), K and V, bfloat16, 63 layers
    assert stages[0].kv_bytes_per_token == stages[1].kv_bytes_per_token == 2 * 63 * 128 * 2
    assert all(0 < s.kv_budget_bytes < 80 * GIB * 0.9 - 40 * GIB for s in stages)


def test_one_stage_of_eight_does_not_fit_80_gib_gpus():
    config = build_engine_config(model="llama-3-405b", device="cuda", dtype="bfloat16", tensor_parallel_size=8)
    (stage,) = stage_figures(config, read_hf_config(config.model), 80.0)
    assert stage.kv_budget_bytes < 0 and stage.kv_tokens == 0


def test_serve_dry_run_prints_each_stage_and_starts_nothing():
    done = shardserve("serve", "--model", "llama-3-405b", "--load-format", "dummy", "-tp", "8", "-pp", "2",
                      "--dry-run", "--gpu-memory-gb", "141")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "16 GPUs" in out and "GPUs of 141 GiB" in out
    assert "stage 0 (ranks 0-7): embedding, layers 0-62 (63)" in out
    assert "stage 1 (ranks 8-15): layers 63-125 (63), norm, LM head, sampling" in out
    assert "weights 47.25 GiB" in out and "the replica's KV cache" in out
    too_small = shardserve("serve", "--model", "llama-3-405b", "-tp", "8", "--dry-run")
    assert too_small.returncode == 0 and "does NOT fit" in too_small.stdout


def test_a_partition_that_does_not_add_up_is_one_line_naming_it():
    done = shardserve("serve", "--model", "llama-3-405b", "-tp", "8", "-pp", "2", "--pp-layer-partition", "60,60",
                      "--dry-run")
    assert_one_line_error(done, "pp_layer_partition", "holds 120 layers; the model has 126")
