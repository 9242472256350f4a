"""The reference helpers themselves: the greedy comparison rule must accept near-ties and reject real mismatches,
and the tiny models must exercise what they claim (random biases, q/k norms, tying)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.hf_reference import HFResult, assert_greedy_match, hf_greedy


def reference_with_logits(token_ids: list[int], rows: list[list[float]]) -> HFResult:
    return HFResult(token_ids, torch.tensor(rows, dtype=torch.float32))


def test_identical_tokens_pass_and_compare_every_position():
    ref = reference_with_logits([1, 2], [[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    comparison = assert_greedy_match([1, 2], ref)
    assert comparison.diverged_at is None
    assert comparison.num_compared == 2


def test_first_difference_at_a_near_tie_passes_and_stops_comparing():
    # Position 1: transformers picked 2 (5.0000) over 1 (4.9995): a tie within 1e-3, so ours (1) is fine,
    # and position 2 onwards is not compared (it would mismatch badly).
    ref = reference_with_logits([0, 2, 0], [[9.0, 0.0, 0.0], [0.0, 4.9995, 5.0], [9.0, 0.0, 0.0]])
    comparison = assert_greedy_match([0, 1, 2], ref)
    assert comparison.diverged_at == 1
    assert comparison.tie_gap == pytest.approx(5e-4, abs=1e-6)


def test_real_mismatch_fails_with_position_and_gap():
    ref = reference_with_logits([0, 2], [[9.0, 0.0, 0.0], [0.0, 4.0, 5.0]])
    with pytest.raises(AssertionError, match=r"position 1: ours 1 vs transformers 2.*gap 1\.000e\+00"):
        assert_greedy_match([0, 1], ref)


def test_only_the_first_difference_may_be_excused():
    # A near-tie later does not excuse an earlier clear mismatch.
    ref = reference_with_logits([0, 2], [[9.0, 0.0, 1.0], [0.0, 5.0, 5.0]])
    with pytest.raises(AssertionError, match="position 0"):
        assert_greedy_match([2, 1], ref)


def test_length_mismatch_without_difference_fails():
    ref = reference_with_logits([0, 1], [[9.0, 0.0], [0.0, 9.0]])
    with pytest.raises(AssertionError, match="length mismatch"):
        assert_greedy_match([0], ref)


def test_out_of_vocabulary_token_fails():
    ref = reference_with_logits([0], [[1.0, 1.0]])
    with pytest.raises(AssertionError, match="outside the vocabulary"):
        assert_greedy_match([7], ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_greedy_is_deterministic_and_logits_chose_the_tokens(tiny_model, arch):
    model_dir = tiny_model(arch)
    prompts = [[5, 17, 99, 3, 42], [200, 13]]
    first = hf_greedy(model_dir, prompts, 6)
    again = hf_greedy(model_dir, prompts, 6)
    for result, repeat in zip(first, again):
        assert len(result.token_ids) == 6  # EOS does not stop it by default
        assert result.token_ids == repeat.token_ids
        assert result.step_logits.shape == (6, 384)
        assert result.step_logits.argmax(dim=-1).tolist() == result.token_ids
        assert_greedy_match(result.token_ids, repeat)


def test_tiny_models_have_the_weights_their_architecture_needs(tiny_model):
    with safe_open(str(Path(tiny_model("qwen2")) / "model.safetensors"), "pt") as f:
        q_bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        assert q_bias.abs().sum() > 0  # random, not transformers' zero init
    with safe_open(str(Path(tiny_model("qwen3")) / "model.safetensors"), "pt") as f:
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        assert not torch.allclose(q_norm, torch.ones_like(q_norm))
    tied_dir = Path(tiny_model("llama", tie_word_embeddings=True))
    assert json.loads((tied_dir / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(tied_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_tiny_llama_accepts_llama3_rope_scaling(tiny_model):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    scaled = hf_greedy(tiny_model("llama", rope_scaling=scaling), [list(range(3, 100))], 3)[0]
    plain = hf_greedy(tiny_model("llama"), [list(range(3, 100))], 3)[0]
    config = json.loads((Path(tiny_model("llama", rope_scaling=scaling)) / "config.json").read_text())
    assert "llama3" in json.dumps(config)
    assert not torch.allclose(scaled.step_logits, plain.step_logits)  # the scaling changes the model
