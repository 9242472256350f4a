"""Model resolution: the default model's one-time GGUF conversion and its cache, built-in configs, local folders,
and clear errors for anything else."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shardserve.settings.model_source import (
    BUILTIN_CONFIGS,
    DEFAULT_MODEL_NAME,
    converted_dir_for,
    default_gguf_path,
    models_cache_root,
    resolve_model,
)
from tests.hf_reference import hf_greedy

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_default_model_is_converted_into_the_user_cache_and_reused(default_model_dir):
    folder = Path(default_model_dir)
    assert folder.parent == models_cache_root()
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    resolved = resolve_model(None, "auto")
    assert resolved.model_dir == str(folder)
    assert resolved.tokenizer_dir == str(folder)
    assert (resolved.load_format, resolved.name) == ("auto", DEFAULT_MODEL_NAME)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # nothing rewritten


def test_gguf_path_resolves_to_the_same_cached_folder(default_model_dir):
    resolved = resolve_model(str(default_gguf_path()))
    assert resolved.model_dir == default_model_dir


def test_cache_folder_follows_the_file_contents_not_its_location(tmp_path):
    # Another checkout's .venv holds the same file elsewhere, with another mtime: same conversion.
    copy = tmp_path / default_gguf_path().name
    shutil.copyfile(default_gguf_path(), copy)
    assert converted_dir_for(copy) == converted_dir_for(default_gguf_path())
    with open(copy, "ab") as f:
        f.write(b"\0")
    assert converted_dir_for(copy) != converted_dir_for(default_gguf_path())


def test_default_model_config_is_smollm2_135m(default_model_dir):
    config = json.loads((Path(default_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    facts = {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "hidden_size", "head_dim", "intermediate_size", "vocab_size")}
    assert facts == {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "hidden_size": 576, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2
    assert "quantization_config" not in config  # dequantized: plain fp32 weights
    assert (Path(default_model_dir) / "model.safetensors").stat().st_size > 500_000_000


def test_default_tokenizer_has_the_chatml_template(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_converted_default_model_greedy_says_paris(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer("The capital of France is")["input_ids"]
    result = hf_greedy(default_model_dir, [prompt], 4, stop_at_eos=True)[0]
    assert " Paris" in tokenizer.decode(result.token_ids)


@pytest.mark.parametrize(
    "name, arch, layers, hidden, heads, kv_heads, vocab, tied",
    [
        ("qwen3-0.6b", "Qwen3ForCausalLM", 28, 1024, 16, 8, 151936, True),
        ("llama-3-8b", "LlamaForCausalLM", 32, 4096, 32, 8, 128256, False),
        ("llama-3-70b", "LlamaForCausalLM", 80, 8192, 64, 8, 128256, False),
        ("llama-3-405b", "LlamaForCausalLM", 126, 16384, 128, 8, 128256, False),
    ],
)
def test_builtin_name_resolves_to_a_shipped_config_with_dummy_weights(name, arch, layers, hidden, heads,
                                                                       kv_heads, vocab, tied):
    resolved = resolve_model(name, "auto")
    assert (resolved.load_format, resolved.tokenizer_dir, resolved.name) == ("dummy", None, name)
    config = json.loads((Path(resolved.model_dir) / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (layers, hidden, heads, kv_heads, vocab)
    assert config["head_dim"] == 128
    assert config["tie_word_embeddings"] is tied
    assert config["torch_dtype"] == "bfloat16"


def test_every_builtin_config_loads_in_transformers():
    from transformers import AutoConfig

    for name in BUILTIN_CONFIGS:
        config = AutoConfig.from_pretrained(resolve_model(name, "dummy").model_dir)
        assert config.num_attention_heads % config.num_key_value_heads == 0


def test_local_folder_is_used_as_is(tiny_model):
    folder = tiny_model("qwen2")
    resolved = resolve_model(folder, "auto")
    assert resolved.model_dir == folder
    assert resolved.tokenizer_dir is None  # tiny models have no tokenizer files
    assert resolved.load_format == "auto"


def test_folder_without_safetensors_needs_dummy_weights(tmp_path):
    (tmp_path / "config.json").write_text(
        (REPO_ROOT / "shardserve" / "settings" / "configs" / "qwen3-0.6b" / "config.json").read_text()
    )
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path), "auto")
    assert resolve_model(str(tmp_path), "dummy").load_format == "dummy"


def test_a_hub_name_missing_from_the_local_cache_is_refused_without_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache, whatever this machine holds
    with pytest.raises(ValueError, match="not in the local Hugging Face cache.*never downloads.*local folder"):
        resolve_model("meta-llama/Meta-Llama-3-8B", "auto")


@pytest.mark.parametrize("model", ["gpt-5", "/no/such/folder", "model.gguf", ""])
def test_unusable_model_argument_raises_value_error_listing_accepted_forms(model):
    with pytest.raises(ValueError, match="built-in config name.*local folder.*gguf"):
        resolve_model(model, "auto")


def test_unknown_load_format_raises_value_error():
    with pytest.raises(ValueError, match="load_format"):
        resolve_model("qwen3-0.6b", "pt")


def test_display_name_is_the_model_as_given_without_server_paths(default_model_dir, tiny_model, tmp_path):
    from shardserve.settings.model_source import display_name

    assert display_name(None) == display_name(default_model_dir) == "SmolLM2-135M-Instruct"  # not the cache folder
    assert os.path.basename(default_model_dir) != "SmolLM2-135M-Instruct"  # which has a hash suffix
    assert display_name("qwen3-0.6b") == "qwen3-0.6b"
    assert display_name(str(tmp_path / "models" / "Mistral-7B.Q4_K_M.gguf")) == "Mistral-7B"
    folder = tiny_model("llama", num_heads=4, num_kv_heads=2)
    assert display_name(folder) == os.path.basename(folder) and display_name(folder + "/") == os.path.basename(folder)


def test_a_conversion_parses_a_gguf_header_once_and_restores_gguf(tmp_path):
    """Inside gguf_parsed_once a file's reader and an architecture's name map are built once (transformers asks
    for them three and ~400 times a conversion); outside, and after an error inside, gguf's own are back."""
    import gguf
    import numpy as np

    from shardserve.settings.model_source import gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, real[0])
        assert first.fields["llama.block_count"].contents() == 2
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real
    assert gguf.GGUFReader(path) is not first
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("a conversion that failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real
