"""worker/models/hf_config.py against transformers' AutoConfig: every value the models and the controller's model
facts read is the one AutoConfig gives, over the configs shipped and tested with and over configs missing the
fields that have defaults; and a worker's model is built without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.settings.resolve import read_model_facts
from shardserve.settings.model_source import BUILTIN_CONFIGS, builtin_config_dir
from shardserve.worker.layers.rotary import rope_settings
from shardserve.worker.models.decoder import head_dim_of
from shardserve.worker.models.hf_config import DEFAULTS, MODEL_TYPES, read_hf_config

ARCHITECTURES = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
SMALL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, vocab_size=300)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def what_the_code_reads(cfg) -> dict:
    """Each value decoder.py, the model classes, rotary.py and read_model_facts take from a config."""
    return dict(
        architectures=cfg.architectures, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg), hidden_act=getattr(cfg, "hidden_act", "silu"),
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)), mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        rope=_rope(cfg), sliding_window=getattr(cfg, "sliding_window", None),
    )


def _rope(cfg) -> tuple:
    """rope_settings' theta and scaling (the scaling dict may repeat the theta, which RotaryEmbedding ignores)."""
    theta, scaling = rope_settings(cfg)
    return theta, {k: v for k, v in scaling.items() if k != "rope_theta"}


def cases() -> dict[str, dict]:
    out = {name: json.loads((builtin_config_dir(name) / "config.json").read_text()) for name in BUILTIN_CONFIGS}
    for model_type, arch in ARCHITECTURES.items():
        out[f"{model_type}-defaults"] = dict(model_type=model_type, architectures=[arch])  # every default
        out[f"{model_type}-small"] = dict(SMALL, model_type=model_type, architectures=[arch])
        out[f"{model_type}-full"] = dict(SMALL, model_type=model_type, architectures=[arch], num_key_value_heads=2,
                                         head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
                                         tie_word_embeddings=True, hidden_act="silu",
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    out["llama-legacy-rope"] = dict(SMALL, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=5e5,
                                    rope_scaling=LLAMA3_ROPE)
    out["llama-bias"] = dict(SMALL, model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True,
                             mlp_bias=True)
    out["mistral-no-window"] = dict(SMALL, model_type="mistral", architectures=["MistralForCausalLM"],
                                    sliding_window=None)
    for flag in (None, False, True):
        case = dict(SMALL, model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=256)
        if flag is not None:
            case["use_sliding_window"] = flag
        out[f"qwen2-window-{flag}"] = case
    return out


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
def test_every_value_read_equals_autoconfigs(tmp_path, name):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(CASES[name]))
    ours = read_hf_config(str(tmp_path))
    theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert what_the_code_reads(ours) == what_the_code_reads(theirs)


def test_the_default_model_and_every_tiny_architecture_read_as_autoconfig_reads_them(default_model_dir, tiny_model):
    from transformers import AutoConfig

    folders = [default_model_dir] + [tiny_model(arch) for arch in ("llama", "qwen2", "qwen3")]
    for folder in folders:
        theirs = AutoConfig.from_pretrained(folder, local_files_only=True)
        assert what_the_code_reads(read_hf_config(folder)) == what_the_code_reads(theirs), folder


def test_the_defaults_table_covers_every_supported_architecture():
    from shardserve.worker.models import SUPPORTED_ARCHITECTURES

    assert set(MODEL_TYPES) == set(SUPPORTED_ARCHITECTURES)
    assert set(MODEL_TYPES.values()) == set(DEFAULTS)


def test_a_config_without_model_type_takes_its_architectures_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, architectures=["Qwen3ForCausalLM"])))
    cfg = read_hf_config(str(tmp_path))
    assert (cfg.model_type, cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings) == ("qwen3", 128, 32, 32768)


def test_the_controllers_facts_take_the_same_defaults_as_the_workers_model(tmp_path):
    """A Qwen2 config naming neither its KV heads nor its window: transformers gives 32 KV heads and no window."""
    (tmp_path / "config.json").write_text(json.dumps(CASES["qwen2-window-None"]))
    facts = read_model_facts(str(tmp_path))
    assert (facts.num_key_value_heads, facts.max_position_embeddings, facts.sliding_window) == (32, 32768, None)


def test_a_quantized_checkpoint_is_refused_naming_its_method_and_the_way_to_fp8_weights(tmp_path):
    config = dict(SMALL, model_type="llama", architectures=["LlamaForCausalLM"],
                  quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoint .*'fp8'.*--quantization fp8"):
        read_model_facts(str(tmp_path))


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        read_hf_config(str(tmp_path))


def test_a_workers_model_is_built_without_importing_transformers(tmp_path):
    """What the reader is for: a worker process never pays transformers' import (~2 s of CPU each)."""
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama-small"]))
    script = f"""
import sys
from shardserve.settings.resolve import build_engine_config
from shardserve.worker.model_runner import ModelRunner
config = build_engine_config(model={str(tmp_path)!r}, load_format="dummy", device="cpu", num_kv_blocks=8,
                             max_model_len=64)
runner = ModelRunner(config)
print(type(runner.model).__name__, "transformers" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["LlamaForCausalLM", "False"]


@pytest.mark.parametrize("text, why", [('{"architectures": ["LlamaForCausalLM"], ', "is not valid JSON"),
                                       ("[1, 2]", "expected a JSON object, got list"),
                                       ('{"model_type": "llama", "num_attention_heads": "four"}',
                                        "num_attention_heads must be a positive integer, got 'four'"),
                                       ('{"model_type": "qwen3", "hidden_size": 0}', "hidden_size must be"),
                                       ('{"model_type": "qwen3", "head_dim": true}', "head_dim must be")])
def test_a_broken_config_is_refused_naming_the_file_and_the_field(tmp_path, text, why):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json") as refused:
        read_hf_config(str(tmp_path))
    assert why in str(refused.value)
