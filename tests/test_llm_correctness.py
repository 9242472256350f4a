"""The whole engine (LLM API: scheduler, block manager, runner, sampler) against transformers, greedy, fp32, CPU.

Tokens must be identical; where they differ, the first difference must be a near-tie (< 1e-3) in transformers' own
logits, and each chosen token's log-probability must be transformers' within tests/hf_reference.LOGPROB_TOL
(tests/hf_reference.assert_greedy_match). After every run every KV block must be free again.
"""

from __future__ import annotations

import random

import pytest

from shardserve import LLM, SamplingParams
from tests.hf_reference import assert_greedy_match, hf_greedy

NEW_TOKENS = 64
# logprobs=0: each chosen token's log-probability too, held to transformers' log-softmax at every step
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

SYSTEM = "You are a careful assistant. Answer briefly and precisely, and say so when you are not sure. "
TEXTS = [
    "Hi",
    "The capital of France is",
    SYSTEM + "What is the tallest mountain on Earth?",
    SYSTEM + "What is the tallest mountain on Earth? Give its height in metres too.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    SYSTEM + "Write a short poem about the sea, the wind, and a small boat far from the shore at night.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who "
    "had never left the valley. Every morning he opened his shop, wound every clock, and waited.",
    SYSTEM + "Explain in plain words why the sky is blue during the day and red at sunset, for a child.",
]


def assert_all_blocks_free(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.all_free(), "a KV block is still held after every request finished"


def check_against_reference(outputs, references) -> None:
    for out, ref in zip(outputs, references):
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_match(out.outputs[0].token_ids, ref, logprobs=out.outputs[0].logprobs)


# ---- the default model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_prompts(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts), "the prompts should have different lengths"
    return prompts


@pytest.fixture(scope="module")
def default_reference(default_model_dir, default_prompts):
    return hf_greedy(default_model_dir, default_prompts, NEW_TOKENS)


@pytest.mark.parametrize(
    "case, options",
    [
        ("prefix-caching-on", dict(enable_prefix_caching=True)),
        ("prefix-caching-off", dict(enable_prefix_caching=False)),
        ("tiny-token-budget-chunked-prefill", dict(max_num_batched_tokens=16)),
        ("too-few-blocks-preemption", dict(num_kv_blocks=24)),
    ],
)
def test_default_model_greedy_matches_transformers(default_model_dir, default_prompts, default_reference, case, options):
    llm = LLM(model=None, **options)
    try:
        outputs = llm.generate(default_prompts, GREEDY, use_tqdm=False)
        check_against_reference(outputs, default_reference)
        assert_all_blocks_free(llm)
        stats = llm.engine.stats()
        if case == "prefix-caching-on":
            # the same batch again: now every shared full block is a cache hit, and the tokens must not change
            again = llm.generate(default_prompts, GREEDY, use_tqdm=False)
            check_against_reference(again, default_reference)
            assert llm.engine.stats().num_cached_prompt_tokens > 0, "no prefix-cache hit happened"
            assert_all_blocks_free(llm)
        if case == "prefix-caching-off":
            llm.generate(default_prompts[:2], GREEDY, use_tqdm=False)
            assert llm.engine.stats().num_cached_prompt_tokens == 0
        if case == "too-few-blocks-preemption":
            assert stats.num_preemptions > 0, "the small cache did not force a preemption"
    finally:
        llm.shutdown()


def _prompt_logprobs(llm: LLM) -> list[float]:
    """The log-probability the model gives each actual next token of TEXTS (prompt_logprobs, one prefill)."""
    outputs = llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [next(iter(d.values())).logprob for out in outputs for d in out.prompt_logprobs if d]


def test_default_model_in_bfloat16_over_three_ranks_stays_near_float32():
    """bfloat16 is what dtype="auto" gives on AMX CPUs (the demo: TP=3, all-reduces in bfloat16 over gloo). Each
    actual next token's log-probability through TP=3 in bfloat16 stays near one rank's in float32: measured on
    2026-12-03 a mean |difference| of 0.053 nats (max 0.32) over 206 positions, as one rank in bfloat16 (0.055);
    with each rank's share times 3 in place of the all-reduce's sum they moved by 10.9 nats on average."""
    reference = LLM(dtype="float32")
    try:
        expected = _prompt_logprobs(reference)
    finally:
        reference.shutdown()
    llm = LLM(dtype="bfloat16", tensor_parallel_size=3)
    try:
        assert llm.engine.config.dtype == "bfloat16"
        got = _prompt_logprobs(llm)
    finally:
        llm.shutdown()
    diffs = [abs(a - b) for a, b in zip(expected, got)]
    assert len(diffs) == len(expected) > 100
    assert sum(diffs) / len(diffs) < 0.15 and max(diffs) < 1.0, (sum(diffs) / len(diffs), max(diffs))


# ---- random-weight tiny models of every architecture ---------------------------------------------------------


def random_prompts(vocab_size: int, seed: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 12, 17, 31, 40, 64, 90][:count]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


TINY_MODELS = {
    "llama-tied-gqa": ("llama", dict(tie_word_embeddings=True, num_heads=4, num_kv_heads=2)),
    "llama-untied-mha": ("llama", dict(tie_word_embeddings=False, num_heads=4, num_kv_heads=4, seed=1)),
    "qwen2-qkv-bias": ("qwen2", dict(num_heads=4, num_kv_heads=2, seed=2)),
    "qwen3-qk-norm": ("qwen3", dict(num_heads=6, num_kv_heads=3, intermediate_size=192, tie_word_embeddings=True, seed=3)),
}


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_greedy_match_transformers_with_chunks_and_preemption(tiny_model, name):
    arch, options = TINY_MODELS[name]
    model_dir = tiny_model(arch, **options)
    prompts = random_prompts(384, seed=len(name))
    reference = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # a small budget (chunked prefill mixed with decodes) and a small cache (preemption) in one run
    llm = LLM(model=model_dir, max_num_batched_tokens=24, num_kv_blocks=20, max_model_len=256)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        check_against_reference(outputs, reference)
        assert llm.engine.stats().num_preemptions > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, name", [(2, "llama-tied-gqa"), (3, "qwen3-qk-norm")])
def test_tensor_parallel_over_gloo_matches_transformers(tiny_model, tp, name):
    arch, options = TINY_MODELS[name]
    model_dir = tiny_model(arch, **options)
    prompts = random_prompts(384, seed=7)
    reference = hf_greedy(model_dir, prompts, NEW_TOKENS)
    with LLM(model=model_dir, tensor_parallel_size=tp, max_model_len=256, num_kv_blocks=40) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        check_against_reference(outputs, reference)
        assert_all_blocks_free(llm)


def test_logprobs_match_transformers_log_softmax(tiny_model):
    import torch

    model_dir = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    prompts = random_prompts(384, seed=11, count=3)
    reference = hf_greedy(model_dir, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    with LLM(model=model_dir, max_model_len=256) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outputs, reference):
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids
        expected = torch.log_softmax(ref.step_logits.double(), dim=-1)
        for step, entry in enumerate(completion.logprobs):
            token = completion.token_ids[step]
            assert next(iter(entry)) == token  # vLLM's dict: the sampled token first
            assert abs(entry[token].logprob - expected[step, token].item()) < 1e-4
            assert entry[token].rank == 1  # greedy
            top = torch.topk(expected[step], 5)
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            assert [t for t, _ in ranked] == top.indices.tolist()
            for (_, got), want in zip(ranked, top.values.tolist()):
                assert abs(got.logprob - want) < 1e-4
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for e, t in
                                                       zip(completion.logprobs, completion.token_ids))) < 1e-9


def hf_prompt_log_softmax(model_dir: str, prompt: list[int]):
    """transformers' fp32 log-softmax at every prompt position: row p scores prompt token p + 1."""
    import torch

    from tests.hf_reference import load_hf_model

    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-prefill", "chunked-prefill"])
def test_prompt_logprobs_match_transformers_and_survive_chunks_and_the_prefix_cache(tiny_model, chunk):
    import torch

    model_dir = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    rng = random.Random(13)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (50, 37)]
    prompts.append(prompts[0][:40] + [5, 6, 7])  # its first two blocks are in the prefix cache by then
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    settings = dict(max_num_batched_tokens=chunk, max_num_seqs=4) if chunk else {}
    with LLM(model=model_dir, max_model_len=256, block_size=16, **settings) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        outputs = first + llm.generate(prompts[1:], params, use_tqdm=False)
        plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    for prompt, out in zip(prompts, outputs):
        expected = hf_prompt_log_softmax(model_dir, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            entry, token = out.prompt_logprobs[position], prompt[position]
            assert next(iter(entry)) == token
            row = expected[position - 1]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4, position
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, 3)
            ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= 3), key=lambda item: item[1].rank)
            assert [t for t, _ in ranked] == top.indices.tolist()
