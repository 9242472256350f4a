"""Engine settings are listed once, in EngineConfig's fields (proto/config.py): the CLI's engine flags, their
kwargs, LLM's keywords and build_engine_config all follow from that list, and user-level values resolve in one
function (shardserve/settings/resolve.py build_engine_config). Built-in configs need no weights, so nothing here loads one."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from shardserve.settings.resolve import CPU_DTYPE_ENV, build_engine_config, cpu_auto_dtype, cpu_bf16_fast
from shardserve.cli.flags import add_engine_args, engine_kwargs
from shardserve.proto.config import EngineConfig, user_default, user_settings

BUILTIN = "qwen3-0.6b"  # max_position_embeddings 40960, 16 heads, 8 KV heads


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_every_field_says_what_it_is_and_every_user_setting_is_a_flag_and_a_keyword():
    assert all(f.metadata["help"] for f in fields(EngineConfig))
    settings = user_settings()
    assert set(settings) == {f.name for f in fields(EngineConfig)} - {"tokenizer", "dist_timeout_s", "block_events"}
    unset = engine_kwargs(parse())
    assert unset == {name: user_default(f) for name, f in settings.items()}  # one flag per setting, its default
    every = dict(unset, model=BUILTIN, device="cpu", num_kv_blocks=8, async_scheduling=False)
    assert isinstance(build_engine_config(**every), EngineConfig)  # every setting is a keyword too


def test_the_flag_spellings_and_defaults_users_know_still_work():
    defaults = engine_kwargs(parse())
    assert defaults == dict(
        model=None, tensor_parallel_size=1, pipeline_parallel_size=1, pp_layer_partition=None, device="auto", dtype="auto", load_format="auto", block_size=16,
        max_num_seqs=None, max_num_batched_tokens=None, max_model_len=None, enable_prefix_caching=True,
        kv_cache_dtype="auto", quantization="none", num_kv_blocks=None, kv_cache_memory_gb=None, gpu_memory_utilization=0.9,
        attention_backend="auto", split_mixed_decodes=0, enforce_eager=False, async_scheduling=None, seed=0,
        speculative_config=None,
    )
    given = engine_kwargs(parse(
        "--model", "m", "--tp", "2", "--device", "cpu", "--dtype", "bf16", "--load-format", "dummy",
        "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "32",
        "--num-kv-blocks", "40", "--kv-cache-memory-gb", "0.5", "--gpu-memory-utilization", "0.8",
        "--attention-backend", "torch", "--enforce-eager", "--no-prefix-caching", "--no-async-scheduling",
        "--seed", "7", "--kv-cache-dtype", "fp8", "--quantization", "fp8", "-pp", "2", "--pp-layer-partition", "3,5",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--split-mixed-decodes", "32",
    ))
    assert given == dict(
        model="m", tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition="3,5", device="cpu", dtype="bf16", load_format="dummy", block_size=32,
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, enable_prefix_caching=False,
        kv_cache_dtype="fp8", quantization="fp8", num_kv_blocks=40, kv_cache_memory_gb=0.5, gpu_memory_utilization=0.8, attention_backend="torch",
        split_mixed_decodes=32, enforce_eager=True, async_scheduling=False, seed=7,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    assert engine_kwargs(parse("--tensor-parallel-size", "4", "--async-scheduling"))["tensor_parallel_size"] == 4
    assert engine_kwargs(parse("--pipeline-parallel-size", "3"))["pipeline_parallel_size"] == 3
    assert engine_kwargs(parse("--pp", "3"))["pipeline_parallel_size"] == 3
    with pytest.raises(SystemExit):
        parse("--device", "gpu")  # choices come from the field too


def test_flags_and_keywords_resolve_to_the_same_config():
    from_flags = build_engine_config(**engine_kwargs(parse("--model", BUILTIN, "--max-model-len", "1024",
                                                           "--dtype", "fp16", "--device", "cpu")))
    assert from_flags == build_engine_config(model=BUILTIN, max_model_len=1024, dtype="fp16", device="cpu")


def test_user_values_are_resolved_in_build_engine_config():
    config = build_engine_config(model=BUILTIN, device="cpu")
    assert config.model.endswith(BUILTIN) and config.tokenizer is None and config.load_format == "dummy"
    assert (config.device, config.dtype) == ("cpu", "float32")  # "auto" dtype on CPU, as the suite pins it
    assert config.max_model_len == 4096  # the model's 40960, capped on CPU
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    assert build_engine_config(model=BUILTIN, device="cpu", dtype="bf16").dtype == "bfloat16"
    assert config.kv_cache_dtype == "float32"  # "auto": the model's dtype, named
    assert build_engine_config(model=BUILTIN, device="cpu", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_engine_config(model=BUILTIN, device="cpu", kv_cache_dtype="int4")
    auto = build_engine_config(model=BUILTIN)
    assert auto.device in ("cpu", "cuda") and auto.dtype == ("bfloat16" if auto.device == "cuda" else "float32")


def test_auto_dtype_on_cpu_is_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch):
    """dtype="auto" on CPU: bfloat16 with AMX bf16 units or AVX-512 BF16 (an AMD EPYC of the Zen 4 family has the
    second and not the first), else float32; SHARDSERVE_CPU_DTYPE decides where set (the suite sets float32,
    conftest.py), and a bad value is an error, not a silent float32."""
    assert cpu_bf16_fast({"amx_bf16": True, "avx512_bf16": True})  # Xeon since Sapphire Rapids
    assert cpu_bf16_fast({"amx_bf16": False, "avx512_bf16": True})  # AMD EPYC Zen 4
    assert not cpu_bf16_fast({"amx_bf16": False, "avx512_bf16": False, "avx512_f": True})  # AVX-512 alone
    assert not cpu_bf16_fast({})
    monkeypatch.delenv(CPU_DTYPE_ENV)
    assert cpu_auto_dtype(bf16_fast=True) == "bfloat16" and cpu_auto_dtype(bf16_fast=False) == "float32"
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if "amx_bf16" in flags or "avx512_bf16" in flags:  # this host's own answer, from the kernel's flags
        assert build_engine_config(model=BUILTIN, device="cpu").dtype == "bfloat16"
    assert build_engine_config(model=BUILTIN, device="cpu").dtype == ("bfloat16" if cpu_bf16_fast() else "float32")
    assert build_engine_config(model=BUILTIN, device="cpu", dtype="fp32").dtype == "float32"  # given: kept
    monkeypatch.setenv(CPU_DTYPE_ENV, "bf16")
    assert cpu_auto_dtype(bf16_fast=False) == "bfloat16"
    assert build_engine_config(model=BUILTIN, device="cpu").dtype == "bfloat16"
    assert build_engine_config(model=BUILTIN, device="cuda").dtype == "bfloat16"  # (CUDA: always bfloat16)
    monkeypatch.setenv(CPU_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=CPU_DTYPE_ENV):
        build_engine_config(model=BUILTIN, device="cpu")


def test_an_offline_batch_takes_larger_steps_on_cuda_unless_told():
    """The step token budget's default: 8192 on CUDA for serving, 16384 for an offline batch (LLM, bench
    offline), 2048 on CPU either way; a value given wins. (A config only: nothing here needs a GPU.)"""
    def budget(**kw):
        return build_engine_config(model=BUILTIN, **kw).max_num_batched_tokens

    assert budget(device="cuda") == 8192 and budget(device="cuda", offline=True) == 16384
    assert budget(device="cpu") == budget(device="cpu", offline=True) == 2048
    assert budget(device="cuda", offline=True, max_num_batched_tokens=4096) == 4096


@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(modle=BUILTIN), TypeError, "modle"),
        (dict(device="gpu"), ValueError, "device must be one of auto, cpu, cuda"),
        (dict(attention_backend="xformers"), ValueError, "attention_backend"),
        (dict(load_format="gguf"), ValueError, "load_format"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(tensor_parallel_size=3), ValueError, "attention heads"),
        (dict(max_model_len=10**6), ValueError, "max_position_embeddings"),
        (dict(block_size=12), ValueError, "power of two"),
    ],
)
def test_bad_settings_are_named(settings, error, message):
    with pytest.raises(error, match=message):
        build_engine_config(**{"model": BUILTIN, **settings})


def test_llm_names_an_unknown_keyword_before_loading_anything():
    from shardserve import LLM

    with pytest.raises(TypeError, match="tensor_paralel_size"):
        LLM(BUILTIN, tensor_paralel_size=2)


def test_vllm_flag_spellings_work_beside_ours():
    import argparse

    from shardserve.cli.flags import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def parsed(*argv):
        return engine_kwargs(parser.parse_args(list(argv)))

    assert parsed("-tp", "3")["tensor_parallel_size"] == parsed("--tensor-parallel-size", "3")["tensor_parallel_size"] == 3
    assert parsed()["enable_prefix_caching"] is True
    assert parsed("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parsed("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parsed("--no-prefix-caching")["enable_prefix_caching"] is False  # the older spelling still works
    assert "--no-prefix-caching" not in parser.format_help()  # ... without a second line in --help


ROOT = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = {".py", ".sh", ".c", ".h", ".toml", ".yaml", ".yml", ".cfg", ".ini"}
SOURCE_NAMES = {"Makefile", "Dockerfile"}


def _settings_table() -> dict[str, str]:
    """docs/architecture.md's settings table: {setting: flag}; an environment setting's name without its note."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Settings: every switch in one table", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            rows[re.match(r"`([A-Za-z0-9_]+)`", cells[0]).group(1)] = cells[1]
    return rows


def _source_files():
    """The project's code, scripts and build files (not hidden folders such as .venv, not docs/)."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("__pycache__", "docs")]
        for file in files:
            path = Path(folder) / file
            if path.suffix in SOURCE_SUFFIXES or path.name in SOURCE_NAMES:
                yield str(path.relative_to(ROOT)), path


def test_the_settings_table_lists_every_engine_setting_with_its_flag():
    """docs/architecture.md's table is EngineConfig's fields, each user setting with its flag (a new field without
    a row, or a row for a field that is gone, fails here)."""
    table = _settings_table()
    engine = {name: flag for name, flag in table.items() if not name.startswith("SHARDSERVE_")}
    assert set(engine) == {f.name for f in fields(EngineConfig)}, "docs/architecture.md's settings table"
    for name, f in user_settings().items():
        spellings = f.metadata["flags"] or ("--" + name.replace("_", "-"),)
        assert any(s.removeprefix("--") in engine[name] for s in spellings), (name, engine[name])


def test_no_environment_switch_outside_the_settings_table():
    """Every SHARDSERVE_* name in the source (code, scripts, build files) is one the settings table documents: a
    new environment switch is a setting (an EngineConfig field) or a row of that table, never a hidden one."""
    documented = {name for name in _settings_table() if name.startswith("SHARDSERVE_")}
    found = {}
    for name, path in _source_files():
        for switch in re.findall(r"SHARDSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            found.setdefault(switch, name)
    assert found, "the scan found no SHARDSERVE_ name at all (the table's own names are used in the source)"
    hidden = {switch: where for switch, where in found.items() if switch not in documented}
    assert not hidden, f"undocumented environment switches (name: a file using it): {hidden}"
