"""The benchmark commands end to end on CPU with a tiny random model: each runs through `shardserve bench ...` and
writes a JSON record with every schema field (no timing asserts: CPU numbers mean nothing). The ceiling arithmetic
is checked against the expected figures for an H200 (4.25 TB/s copy bandwidth, 785 TFLOP/s bf16)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from types import SimpleNamespace

import pytest

from shardserve.bench.compare_hf import hf_dtype
from shardserve.cli.main import main as cli
from shardserve.proto.config import EngineConfig

SCHEMA = ("benchmark", "model", "load_format", "device", "num_gpus", "tp", "replicas", "workload",
          "output_tokens_per_s", "total_tokens_per_s", "ceiling_output_tokens_per_s", "ms_per_token", "ratio_vs_hf",
          "control_plane_share", "speedup_vs_1", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "peak_memory_gb",
          "command", "date", "commit")
SMALL = ["--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64", "--load-format", "dummy"]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama", num_heads=4, num_kv_heads=2)


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "record.json"
    assert cli(["bench", *args, *SMALL, "--json-out", str(out)]) == 0
    record = json.loads(out.read_text())
    missing = [f for f in SCHEMA if f not in record]
    assert not missing, f"record lacks {missing}"
    return record


def test_offline_record_has_throughput_the_ceiling_and_the_ratio_to_transformers(model_dir, tmp_path):
    record = run_bench(tmp_path, "offline", "--model", model_dir, "--num-prompts", "6", "--input-len", "8-24",
                       "--output-len", "4-10", "--compare", "hf", "--hf-prompts", "3",
                       "--hf-dtype", "bf16")
    assert record["benchmark"] == "offline" and record["workload"]["num_prompts"] == 6 and record["tp"] == 1
    assert record["output_tokens_per_s"] > 0 and record["total_tokens_per_s"] > record["output_tokens_per_s"]
    assert record["ceiling_output_tokens_per_s"] > 0
    arithmetic = record["notes"]["ceiling"]["arithmetic"]
    assert any(line.startswith("ceiling:") for line in arithmetic) and "copy" in arithmetic[0]
    phases = record["notes"]["phases"]  # the workers' own time beside the wall time, inside it (CPU steps: synchronous)
    assert 0 < phases["decode_device_s"] <= phases["decode_s"] and 0 < phases["prefill_device_s"] <= phases["prefill_s"]
    for bucket in phases["decode_by_batch"].values():
        assert bucket["device_ms_per_step"] == pytest.approx(bucket["device_s"] * 1e3 / bucket["steps"])
        assert 0 < bucket["device_s"] <= bucket["s"]
    hf = record["notes"]["hf"]
    assert hf["method"] == "generate (padded)" and hf["output_tokens"] == 3 * 10  # fixed length: the range's top
    assert hf["dtype"] == "bfloat16" and record["dtype"] == "float32"  # --hf-dtype: transformers' own dtype
    assert record["ratio_vs_hf"] == pytest.approx(record["notes"]["hf_sample"]["shardserve_output_tokens_per_s"]
                                                  / hf["output_tokens_per_s"])


def test_hf_dtype_is_the_engines_the_checkpoints_or_a_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    config = SimpleNamespace(model=str(tmp_path), dtype="float32")
    assert hf_dtype("same", config) == "float32" and hf_dtype("checkpoint", config) == "bfloat16"
    assert hf_dtype("fp16", config) == "float16"
    (tmp_path / "config.json").write_text("{}")  # no dtype named: transformers loads float32
    assert hf_dtype("checkpoint", config) == "float32"


def test_latency_record_has_ms_per_token_the_weight_read_bound_and_every_setting(model_dir, tmp_path):
    record = run_bench(tmp_path, "latency", "--model", model_dir, "--input-len", "16", "--output-len", "10",
                       "--split-mixed-decodes", "3")
    assert set(record["settings"]) == {f.name for f in fields(EngineConfig)}
    assert record["settings"]["split_mixed_decodes"] == 3 and record["settings"]["block_size"] == 16
    assert record["benchmark"] == "latency" and record["ms_per_token"] > 0
    assert record["tpot_ms"]["p50"] == record["ms_per_token"]
    assert record["notes"]["decode_steps_timed"] == 10 - 1 - 3  # prefill and 3 warm-up decode steps left out
    assert record["notes"]["weight_read_bound_ms"] > 0


def test_latency_with_ngram_speculation_on_the_grounded_workload_records_tokens_per_s_and_acceptance(
        model_dir, tmp_path):
    record = run_bench(tmp_path, "latency", "--model", model_dir, "--workload", "grounded", "--input-len", "40",
                       "--output-len", "12",
                       "--no-roofline", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert record["workload"]["kind"] == "grounded" and record["output_tokens_per_s"] > 0
    spec = record["notes"]["speculation"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert record["notes"]["decode_tokens_per_s"] > 0


def test_control_plane_record_in_process(model_dir, tmp_path):
    record = run_bench(tmp_path, "control-plane", "--model", model_dir, "--executor", "local", "--num-prompts", "4",
                       "--input-len", "8", "--output-len", "8")
    local = record["notes"]["executors"]["local"]
    assert local["decode_steps"] == 8 - 1  # every decode step had the whole batch
    assert record["control_plane_share"] == local["share"] and local["share"] < 1


def test_offline_through_the_cluster_reports_its_ratio_and_control_plane(model_dir, tmp_path):
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    try:
        record = run_bench(tmp_path, "offline", "--model", model_dir, "--num-prompts", "4", "--input-len", "8",
                           "--output-len", "6", "--cluster", "--no-roofline")
    finally:
        if started_here:
            ray.shutdown()
    cluster = record["notes"]["cluster"]
    assert cluster["output_tokens_per_s"] > 0 and cluster["ratio_to_local"] > 0
    assert record["control_plane_share"] == cluster["control_plane"]["share"]


def test_ceiling_arithmetic_reproduces_the_h200_numbers():
    from transformers import AutoConfig

    from shardserve.bench.roofline import DeviceRates, ModelShape, weight_read_bound_ms, workload_ceiling
    from shardserve.bench.workload import random_workload
    from shardserve.settings.model_source import builtin_config_dir

    h200 = DeviceRates("H200 (environment notes)", 4.25e12, 785e12, 2 << 30, 8192)
    llama = AutoConfig.from_pretrained(builtin_config_dir("llama-3-8b"))
    # Expected: bs=1 weight-read bound 3.53 ms at TP=1 and 1.77 ms at TP=2.
    assert weight_read_bound_ms(ModelShape.from_hf_config(llama, 1), h200) == pytest.approx(3.53, abs=0.01)
    assert weight_read_bound_ms(ModelShape.from_hf_config(llama, 2), h200) == pytest.approx(1.77, abs=0.01)
    # Expected: ceilings of about 18,800 (Llama-3-8B) and 37,800 (Qwen3-0.6B) on nano-vllm's workload.
    for name, expected in (("llama-3-8b", 18_800), ("qwen3-0.6b", 37_800)):
        cfg = AutoConfig.from_pretrained(builtin_config_dir(name))
        work = random_workload(256, (100, 1024), (100, 1024), cfg.vocab_size, seed=0)
        result = workload_ceiling(ModelShape.from_hf_config(cfg), h200, [len(p) for p in work.prompts],
                                  work.output_lens)
        assert result["ceiling_output_tokens_per_s"] == pytest.approx(expected, rel=0.05)


def test_ceiling_with_fp8_weights_reads_a_byte_a_weight_and_multiplies_at_twice_the_rate():
    from transformers import AutoConfig

    from shardserve.bench.roofline import DeviceRates, ModelShape, weight_read_bound_ms, workload_ceiling
    from shardserve.bench.workload import random_workload
    from shardserve.settings.model_source import builtin_config_dir

    h200 = DeviceRates("H200 (environment notes)", 4.25e12, 785e12, 2 << 30, 8192)
    llama = AutoConfig.from_pretrained(builtin_config_dir("llama-3-8b"))
    plain, fp8 = ModelShape.from_hf_config(llama), ModelShape.from_hf_config(llama)
    fp8.fp8_linear = True
    # the LM head (1.05 GB in bf16) keeps its dtype: 3.53 ms -> (6.98 GB / 2 + 1.05 GB) / 4.25 TB/s = 1.07 + 0.25
    assert weight_read_bound_ms(fp8, h200) == pytest.approx(1.89, abs=0.02)
    assert weight_read_bound_ms(plain, h200) == pytest.approx(3.53, abs=0.01)
    work = random_workload(256, (100, 1024), (100, 1024), llama.vocab_size, seed=0)
    lens = [len(p) for p in work.prompts]
    a, b = (workload_ceiling(shape, h200, lens, work.output_lens) for shape in (plain, fp8))
    assert b["prefill_s"] < 0.55 * a["prefill_s"]  # the linear FLOPs (nearly all of prefill's) at twice the rate
    assert b["ceiling_output_tokens_per_s"] > a["ceiling_output_tokens_per_s"]
    assert any("linear weights FP8" in line for line in b["arithmetic"])


def test_kv_quality_compares_fp8_weights_against_the_models_dtype(model_dir, tmp_path):
    out = tmp_path / "q.json"
    assert cli(["bench", "kv-quality", "--model", model_dir, *SMALL, "--fp8", "weights", "--num-prompts", "2",
                "--max-tokens", "4", "--json-out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["quantization"] == "fp8" and record["kv_cache_dtype"] == "float32"
    assert record["workload"]["reference_quantization"] == "none" and record["notes"]["positions"] == 2 * 4
    assert record["notes"]["kl_mean"] > 0  # the weights were quantized: the distributions moved


def test_timed_executor_offers_submit_and_collect_only_when_the_executor_has_them():
    from shardserve.bench.harness import TimedExecutor
    from shardserve.proto.plan import StepPlan, StepResult

    class Sync:
        num_kv_blocks = 8

        def execute(self, plan):
            return StepResult(plan.step_id, forward_ms=2.0)

    class Async(Sync):
        def __init__(self):
            self.queue = []

        def submit(self, plan):
            self.queue.append(plan)

        def collect(self):
            return self.execute(self.queue.pop(0))

    assert getattr(TimedExecutor(Sync()), "submit", None) is None
    timed = TimedExecutor(Async())
    timed.submit(StepPlan(1, req_ids=["a", "b"], num_tokens=[1, 1]))
    timed.submit(StepPlan(2, req_ids=["a"], num_tokens=[5]))
    assert timed.collect().step_id == 1 and timed.collect().step_id == 2
    assert [(t.num_seqs, t.num_tokens, t.decode_only, t.forward_ms) for t in timed.timings] == [
        (2, 2, True, 2.0), (1, 5, False, 2.0)]


def test_profile_writes_the_operator_table_of_the_timed_run(model_dir, tmp_path):
    table = tmp_path / "profile.txt"
    run_bench(tmp_path, "latency", "--model", model_dir, "--input-len", "16", "--output-len", "6", "--no-roofline",
              "--profile", str(table))
    text = table.read_text()
    # the model's matmuls ran inside the profiled window (on CPU through oneDNN's packed weights, else aten::mm)
    assert "Self CPU" in text and ("mkldnn::_linear_pointwise" in text or "aten::mm" in text)


def test_probe_reports_each_part_of_a_step_per_batch_size(model_dir, tmp_path):
    out = tmp_path / "probe.json"
    assert cli(["bench", "probe", "--model", model_dir, *SMALL, "--batch-sizes", "1,4", "--context-len", "40",
                "--repeats", "3", "--prefill-tokens", "64", "--prefill-seq-len", "32", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [d["batch"] for d in report["decode"]] == [1, 4]
    for part in report["decode"]:
        assert all(part[k] > 0 for k in ("step_ms", "launch_host_ms", "lm_head_ms", "sample_ms", "sample_greedy_ms"))
        assert part["profile"]["kernels_per_step"] > 0 and part["profile"]["top"]
    assert report["prefill"]["tokens"] == 64 and report["prefill"]["tokens_per_s"] > 0


def test_offline_without_workload_flags_on_cpu_is_cpu_sized_shows_progress_and_names_the_record(
        model_dir, tmp_path, capsys):
    out = tmp_path / "auto.json"
    assert cli(["bench", "offline", "--model", model_dir, "--device", "cpu", "--load-format", "dummy",
                "--max-model-len", "256", "--no-roofline", "--json-out", str(out)]) == 0
    printed = capsys.readouterr()
    record = json.loads(out.read_text())
    assert record["workload"]["num_prompts"] == 16
    assert (record["workload"]["input_len"], record["workload"]["output_len"]) == ("32-128", "32-128")
    assert f"record: {out}" in printed.out
    summary = re.search(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$",
                        printed.out, flags=re.M)  # vLLM's plain summary line
    assert summary and float(summary.group(2)) > float(summary.group(3)) > 0
    assert float(summary.group(3)) == pytest.approx(record["output_tokens_per_s"], rel=1e-3)
    assert "shardserve: 100%" in printed.err and "tok/s" in printed.err  # the tqdm bar over output tokens


def test_host_bench_runs_every_request_to_its_length_and_times_the_workers_part_inside_the_step(model_dir, tmp_path):
    """`bench host`: the real engine over an executor that only prepares the worker's inputs; every request gets its
    max_tokens (the executor answers each sampling row), and each batch range's worker time is within its step time."""
    record = run_bench(tmp_path, "host", "--model", model_dir, "--num-prompts", "12", "--input-len", "8-40",
                       "--output-len", "3-30", "--max-num-seqs", "8")
    notes = record["notes"]
    from shardserve.bench.workload import parse_range, random_workload

    workload = random_workload(12, parse_range("8-40"), parse_range("3-30"), 384, seed=0)
    assert notes["output_tokens"] == workload.num_output_tokens
    assert record["workload"]["detokenize"] is False and record["workload"]["final_only"] is False
    buckets = notes["by_batch"]
    assert sum(b["steps"] for b in buckets.values()) == notes["steps"] and "8-15" in buckets  # the batch reached 8
    for b in buckets.values():
        assert 0 < b["worker_ms_per_step"] <= b["ms_per_step"]


def test_host_bench_detokenizes_with_the_models_tokenizer_and_refuses_a_model_without_one(default_model_dir, model_dir,
                                                                                          tmp_path, capsys):
    record = run_bench(tmp_path, "host", "--model", default_model_dir, "--num-prompts", "4", "--input-len", "8",
                       "--output-len", "5", "--detokenize")
    assert record["workload"]["detokenize"] is True and record["notes"]["output_tokens"] == 20
    one_delta = run_bench(tmp_path, "host", "--model", default_model_dir, "--num-prompts", "4", "--input-len", "8",
                          "--output-len", "5", "--final-only")
    assert one_delta["workload"]["final_only"] is True and one_delta["notes"]["output_tokens"] == 20
    assert cli(["bench", "host", "--model", model_dir, *SMALL, "--detokenize"]) == 2
    assert "--detokenize needs a model with a tokenizer" in capsys.readouterr().err


def test_offline_repeats_report_the_median_run_and_every_run(model_dir, tmp_path):
    record = run_bench(tmp_path, "offline", "--model", model_dir, "--num-prompts", "4", "--input-len", "8-24",
                       "--output-len", "4-10", "--repeats", "3", "--no-roofline")
    runs = record["notes"]["repeats"]["runs"]
    assert len(runs) == 3
    figures = sorted(r["output_tokens_per_s"] for r in runs)
    assert record["output_tokens_per_s"] == figures[1]  # the median run is the record's figure
    headline = runs[int(record["notes"]["repeats"]["headline"].split()[1].rstrip(":")) - 1]
    assert headline["elapsed_s"] == record["notes"]["elapsed_s"]


def test_a_shifted_workload_keeps_the_lengths_and_shares_no_prompt_start():
    from shardserve.bench.workload import FIRST_ID, random_workload

    base = random_workload(50, (1, 64), (1, 8), 384, seed=3)
    for k in (1, 2, 7):
        moved = base.shifted(k, 384)
        assert [len(p) for p in moved.prompts] == [len(p) for p in base.prompts]
        assert moved.output_lens == base.output_lens
        assert all(FIRST_ID <= t < 384 for p in moved.prompts for t in p)
        assert all(a[0] != b[0] for a, b in zip(moved.prompts, base.prompts))  # no prefix-cache hit on the base
    assert base.shifted(0, 384).prompts == base.prompts
    span = random_workload(5, (4, 4), (1, 1), FIRST_ID + 1009, seed=0)  # 1009 ids: the plain shift would be none
    assert all(a != b for a, b in zip(span.shifted(1, FIRST_ID + 1009).prompts, span.prompts))
