"""What a vLLM user types works: `serve MODEL` (the positional model), `LLM(model="org/name")` for a copy already in
the local Hugging Face cache (found on disk, never downloaded; a missing one says so), `trust_remote_code` accepted
with a warning, and `generate --prompt-token-ids` for models without a tokenizer. ~10 s (a tiny model)."""

from __future__ import annotations

import shutil

import pytest

from shardserve.cli.main import build_parser
from shardserve.cli.main import main as cli
from shardserve.cli.server_commands import positional_model
from shardserve.settings.model_source import resolve_model


def test_serve_takes_the_model_as_its_positional_argument():
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--tp", "1"])
    positional_model(args)
    assert args.model == "Qwen/Qwen3-0.6B"
    args = build_parser().parse_args(["serve", "a/b", "--model", "a/b"])
    positional_model(args)
    assert args.model == "a/b"
    args = build_parser().parse_args(["serve", "a/b", "--model", "c/d"])
    with pytest.raises(ValueError, match="given twice"):
        positional_model(args)
    assert build_parser().parse_args(["serve"]).model is None


def test_a_hub_id_resolves_to_its_copy_in_the_local_hf_cache_and_a_missing_one_says_nothing_is_downloaded(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny_model("llama"), repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    resolved = resolve_model("acme/tiny-llama")
    assert resolved.model_dir == str(repo / "snapshots" / "0123abcd") and resolved.name == "tiny-llama"
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache .*never downloads"):
        resolve_model("acme/elsewhere")


def test_trust_remote_code_is_accepted_with_a_warning(tiny_model, capsys):
    from shardserve import LLM

    with pytest.warns(UserWarning, match="trust_remote_code: accepted and ignored"):
        llm = LLM(model=tiny_model("llama"), trust_remote_code=True, num_kv_blocks=16, max_model_len=64)
    llm.shutdown()
    args = build_parser().parse_args(["generate", "hi", "--trust-remote-code"])
    from shardserve.cli.flags import engine_kwargs

    assert "trust_remote_code" not in engine_kwargs(args)
    assert "--trust-remote-code: accepted and ignored" in capsys.readouterr().err


def test_generate_sends_token_ids_and_prints_the_output_ids_of_a_model_without_a_tokenizer(tiny_model, capsys):
    assert cli(["generate", "--model", tiny_model("llama"), "--prompt-token-ids", "1,5,9", "--max-tokens", "3",
                "--ignore-eos", "--max-model-len", "64", "--num-kv-blocks", "16"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 3 and all(t.isdigit() for t in ids)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt-token-ids", "1,x"])
    assert cli(["generate", "hi", "--prompt-token-ids", "1"]) == 2  # one prompt, not two
