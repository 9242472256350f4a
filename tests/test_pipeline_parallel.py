"""Pipeline parallelism through the whole engine (LLM over local worker processes, gloo point to point between
stages) against transformers, greedy, fp32, CPU: PP=2, PP=2 x TP=2 and PP=3 on tiny random Llama / Qwen3 shapes
and PP=2 on the default model, with chunked prefill, preemption and prefix-cache hits in the same runs.

Each run keeps several plans in flight (one per stage, on disjoint requests), so the stages before the last take
their requests' sampled tokens from the plans; a token missing or wrong there changes every later token."""

from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.test_llm_correctness import assert_all_blocks_free, check_against_reference, random_prompts

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

CASES = {
    # name: (arch, tiny-model options, LLM options)
    "pp2-llama-tied": ("llama", dict(tie_word_embeddings=True, num_layers=4),
                       dict(pipeline_parallel_size=2)),
    "pp2xtp2-qwen3-qk-norm": ("qwen3", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True, num_layers=2,
                                            seed=3),
                              dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
    "pp3-llama-untied-uneven": ("llama", dict(tie_word_embeddings=False, num_layers=4, seed=1),
                                dict(pipeline_parallel_size=3, pp_layer_partition="1,2,1")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_stages_match_transformers_with_chunks_preemption_and_prefix_hits(tiny_model, name):
    arch, model_options, options = CASES[name]
    model_dir = tiny_model(arch, **model_options)
    prompts = random_prompts(384, seed=5, count=6)
    reference = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # a small budget (chunked prefill beside decodes) and a small cache (preemption) in one run
    with LLM(model=model_dir, max_model_len=256, max_num_batched_tokens=24, num_kv_blocks=16, **options) as llm:
        assert llm.engine.max_plans_in_flight == options["pipeline_parallel_size"] or name.startswith("pp2")
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        check_against_reference(outputs, reference)
        assert llm.engine.stats().num_preemptions > 0, "the small cache did not force a preemption"
        assert_all_blocks_free(llm)
        # the shortest prompts again: their full blocks are prefix-cache hits now, and the tokens must not change
        again = llm.generate(prompts[1:4], GREEDY, use_tqdm=False)
        check_against_reference(again, reference[1:4])
        assert llm.engine.stats().num_cached_prompt_tokens > 0, "no prefix-cache hit happened"
        assert_all_blocks_free(llm)
        if name.startswith("pp3"):  # seeded sampling, logprobs and prompt logprobs: as one rank gives them
            sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2,
                                     prompt_logprobs=1)
            got = llm.generate(prompts[:3], sampled, use_tqdm=False)
            with LLM(model=model_dir, max_model_len=256) as one:
                want = one.generate(prompts[:3], sampled, use_tqdm=False)
            for g, w in zip(got, want):
                assert g.outputs[0].token_ids == w.outputs[0].token_ids
                assert _rounded(g.outputs[0].logprobs) == _rounded(w.outputs[0].logprobs)
                assert _rounded(g.prompt_logprobs) == _rounded(w.prompt_logprobs)


def _rounded(positions):
    """{token: logprob to 4 places} per position (None stays None): what the stages and one rank must agree on."""
    return [None if p is None else {t: round(lp.logprob, 4) for t, lp in p.items()} for p in positions]


def test_default_model_over_two_stages_matches_transformers(default_model_dir):
    from transformers import AutoTokenizer

    from tests.test_llm_correctness import TEXTS

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[1:3]]
    reference = hf_greedy(default_model_dir, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=None, dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        check_against_reference(outputs, reference)
        assert_all_blocks_free(llm)
