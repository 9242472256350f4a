"""LLM(data_parallel_size=2): two engines, each over its own group of local worker processes (real gRPC on
127.0.0.1), stepped at once. Proves: greedy outputs equal one engine's, in prompt order; unrelated prompts spread
over both engines; prompts sharing a long prefix follow each other to one engine and hit its prefix cache; a bad
size is refused before anything starts."""

from __future__ import annotations

import random

import pytest

from shardserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", num_heads=4, num_kv_heads=2)


def _prompts(seed: int, n: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(n)]


def test_two_groups_give_one_engines_greedy_tokens_and_share_the_work(model):
    prompts = _prompts(0, 12)
    settings = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    with LLM(model, **settings) as one:
        reference = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, data_parallel_size=2, **settings) as llm:
        assert len(llm.engines) == 2 and llm.engines[0].executor is not llm.engines[1].executor
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        finished = [e.num_finished for e in llm.engines]
        assert sum(finished) == 12 and min(finished) >= 4  # least outstanding tokens: the load is shared

        # eight prompts behind one 64-token prefix: all on one engine, all but the first from its cache
        prefix = _prompts(1, 1, 64)[0]
        shared = [prefix + tail for tail in _prompts(2, 8, 8)]
        before = [e.num_finished for e in llm.engines]
        first = llm.generate(shared[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(shared[1:], GREEDY, use_tqdm=False)
        grew = [e.num_finished - b for e, b in zip(llm.engines, before)]
        assert sorted(grew) == [0, 8]
        assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 64 for o in rest)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_bad_data_parallel_size_is_refused(size):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(data_parallel_size=size)
