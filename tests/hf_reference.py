"""transformers as the reference: tiny random-weight models, greedy generation with per-step logits, and the
comparison rule for greedy token ids.

Random weights make near-ties in logits, where fp32 rounding differences between two correct implementations
can pick different tokens. The rule (assert_greedy_match): identical, or the first difference is a near-tie in
transformers' own logits at that step; after it the continuations diverge legitimately and are not compared.
A real mismatch (a clear winner that we did not pick) always fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from shardserve.settings.model_source import hub_offline

TINY_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass
class HFResult:
    token_ids: list[int]  # generated tokens only (the prompt excluded)
    step_logits: torch.Tensor  # [len(token_ids), vocab] fp32: raw logits each generated token was chosen from


@dataclass(frozen=True)
class GreedyComparison:
    num_compared: int  # positions checked (all of them when identical; up to the first difference otherwise)
    diverged_at: int | None  # first differing position, accepted as a near-tie; None when identical
    tie_gap: float | None  # transformers' top-1 logit minus our token's logit there


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 384,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    seed: int = 0,
    initializer_range: float = 0.1,
) -> str:
    """Save a random-weight tiny Hugging Face model (fp32 safetensors, config.json) and return its folder.

    Every parameter is random, biases and norm weights included: transformers would initialize qkv biases to
    zero and norm weights to one, which would leave Qwen2's bias and Qwen3's q/k norms untested.
    rope_scaling takes the classic config form, e.g. {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128} (llama only).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)  # qkv bias is built into Qwen2's attention
    else:
        config = Qwen3Config(**common, use_sliding_window=False, attention_bias=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(initializer_range * torch.randn(param.shape, generator=generator))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=2)
def load_hf_model(model_dir: str):
    """transformers' model from a local folder, fp32 on CPU, eval mode (kept for the next call on the same folder)."""
    from transformers import AutoModelForCausalLM

    with hub_offline():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu").eval()


def hf_greedy(
    model_dir: str, prompts_token_ids: list[list[int]], max_new_tokens: int, *, stop_at_eos: bool = False
) -> list[HFResult]:
    """transformers' greedy generate with each step's raw logits.

    stop_at_eos=False generates exactly max_new_tokens, EOS included as an ordinary token: the reference for
    our engine with ignore_eos=True. Then the prompts go as one batch, left-padded (the attention mask hides the
    padding and generate derives the positions from it): on the default model, 8 prompts x 64 tokens, the same
    tokens as one prompt at a time, every logit within 1e-4 of it (the near-tie tolerance is 1e-3), in 7.7 s
    against 33.6 s on 2 cores. stop_at_eos=True runs one prompt at a time (no padding after an early EOS).
    """
    from transformers import GenerationConfig

    model = load_hf_model(str(model_dir))
    eos = model.config.eos_token_id if stop_at_eos else None
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    # generate() fills fields left unset (None) from the model's own generation config, EOS among them:
    # clear it there too while we run, or "no EOS" would silently mean the model's EOS.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    results = []
    try:
        if not stop_at_eos and len(prompts_token_ids) > 1:
            return _greedy_batch(model, prompts_token_ids, generation_config)
        for prompt in prompts_token_ids:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
                )
            generated = out.sequences[0, len(prompt) :].tolist()
            logits = torch.cat([step.float() for step in out.logits], dim=0)
            results.append(HFResult(generated, logits[: len(generated)]))
    finally:
        model.generation_config.eos_token_id = saved_eos
    return results


# How far our log-probability of each chosen token may be from transformers' log-softmax at that step (fp32, CPU).
# Measured on the default model (8 prompts x 32 greedy tokens, 2026-12-07): at most 3.3e-5 nats, and up to
# 3.6e-3 with the decode attention's scale 0.1% off (a bug every greedy token survives; tests/test_mutants.py).
LOGPROB_TOL = 2e-4


def assert_greedy_match(ours: list[int], ref: HFResult, tie_tol: float = 1e-3,
                        logprobs: list | None = None) -> GreedyComparison:
    """Pass when our greedy tokens equal transformers', or first differ at a near-tie in transformers' logits;
    and, given our logprobs (a float or a {token: Logprob} dict per generated token: SamplingParams(logprobs=0)),
    when each chosen token's log-probability is within LOGPROB_TOL of transformers' log-softmax at that step.

    At the first difference the prefixes are still identical, so transformers' logits there are the right
    judge: if its top-1 logit beats our token's by less than tie_tol, either choice is correct and the rest is
    not compared. Anything else raises AssertionError naming the position and the gap. Greedy tokens alone are a
    blunt check (a slightly wrong attention scale keeps every argmax): the log-probabilities see a small error.
    """
    ours = list(ours)
    reference = ref.token_ids
    if logprobs is not None:
        assert len(logprobs) == len(ours), f"{len(logprobs)} logprobs for {len(ours)} tokens"
    for position, (our_token, ref_token) in enumerate(zip(ours, reference)):
        if logprobs is not None and 0 <= our_token < ref.step_logits[position].numel():
            _assert_logprob_close(position, our_token, logprobs[position], ref.step_logits[position])
        if our_token == ref_token:
            continue
        step_logits = ref.step_logits[position]
        if not 0 <= our_token < step_logits.numel():
            raise AssertionError(
                f"greedy mismatch at generated position {position}: our token {our_token} is outside the "
                f"vocabulary (size {step_logits.numel()}); transformers chose {ref_token}"
            )
        top1 = step_logits.max().item()
        gap = top1 - step_logits[our_token].item()
        if gap < tie_tol:
            return GreedyComparison(position, position, gap)
        raise AssertionError(
            f"greedy mismatch at generated position {position}: ours {our_token} vs transformers {ref_token}; "
            f"transformers' logits: top-1 {top1:.6f}, ours {step_logits[our_token].item():.6f}, "
            f"gap {gap:.3e} >= tie tolerance {tie_tol:.0e} (not a near-tie)\n"
            f"  ours:         {ours[: position + 1]}\n  transformers: {reference[: position + 1]}"
        )
    if len(ours) != len(reference):
        raise AssertionError(
            f"greedy length mismatch: ours {len(ours)} tokens, transformers {len(reference)}, identical over "
            f"the first {min(len(ours), len(reference))} (one side stopped early: EOS or max_tokens settings differ?)"
        )
    return GreedyComparison(len(ours), None, None)


def _assert_logprob_close(position: int, token: int, ours, step_logits: torch.Tensor) -> None:
    value = ours[token].logprob if isinstance(ours, dict) else float(ours)
    expected = torch.log_softmax(step_logits.double(), dim=-1)[token].item()
    assert abs(value - expected) < LOGPROB_TOL, (
        f"generated position {position}, token {token}: our logprob {value:.6f}, transformers' {expected:.6f} "
        f"(|difference| {abs(value - expected):.2e} >= {LOGPROB_TOL:.0e})")


def _greedy_batch(model, prompts_token_ids: list[list[int]], generation_config) -> list[HFResult]:
    """Every prompt in one left-padded generate call (exactly max_new_tokens each: no EOS stops a row)."""
    width = max(len(p) for p in prompts_token_ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts_token_ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_token_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, generation_config=generation_config)
    logits = torch.stack([step.float() for step in out.logits], dim=1)  # [prompts, steps, vocab]
    return [HFResult(out.sequences[i, width:].tolist(), logits[i]) for i in range(len(prompts_token_ids))]
