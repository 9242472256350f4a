"""Speculative decoding (n-gram proposals verified in one forward) on a real tiny model: the outputs are exactly
those of decoding without speculation, for greedy and seeded requests alike, in a batch with plain requests,
with prefix caching, chunked prefill, preemption, penalties, logprobs, stop strings and max_tokens landing inside
a run of accepted drafts; and greedy tokens match transformers.

A planted bug shows the comparison can fail: a worker that keeps every draft unconditionally (monkeypatched
accepted_count) changes the outputs.
"""

from __future__ import annotations

import pytest

from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig
from shardserve.proto.speculative import SpeculativeConfig
from shardserve.worker import spec_verify
from shardserve.worker.inprocess import InProcessExecutor
from tests.cluster._tiny_tokenizer import byte_level_bpe
from tests.engine_driver import drive

BS = 4
VOCAB = 384
EOS = 2
# Repeated motifs: the tiny random model copies some of them, so n-gram drafts are proposed and partly accepted.
MOTIFS = [[10 + 3 * i + j for j in range(2 + i % 4)] for i in range(6)]
PROMPTS = [(m * 5)[: 7 + 3 * i] + [100 + i] + m * 2 for i, m in enumerate(MOTIFS)]
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3).to_json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-spec"), "llama")


def config(model_dir: str, speculative: str | None, **overrides) -> EngineConfig:
    settings = dict(model=model_dir, block_size=BS, num_kv_blocks=128, max_model_len=128,
                    max_num_batched_tokens=256, max_num_seqs=8, speculative_config=speculative)
    settings.update(overrides)
    return EngineConfig(**settings)


def params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=11 + i, top_p=0.9),
        dict(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        dict(temperature=1.0, seed=5, frequency_penalty=0.5, top_k=20, logprobs=1),
        dict(temperature=0.0, stop=["e"], min_tokens=2),
        dict(temperature=0.0, max_tokens=7),
    ]
    kind = kinds[i % len(kinds)]
    return SamplingParams(**{"max_tokens": 24 + 5 * (i % 3), **kind})


def run(cfg: EngineConfig, prompts=PROMPTS, make_params=params, rounds: int = 1, make_executor=InProcessExecutor
        ) -> tuple[dict, Engine]:
    """Every prompt, `rounds` times one round after the other on one engine (later rounds hit the prefix cache)."""
    engine = Engine(cfg, make_executor(cfg), byte_level_bpe(), [EOS], vocab_size=VOCAB)
    outputs = {}
    try:
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                engine.admit(f"{r}-{i}", prompt, make_params(i))
            drive(engine, max_steps=2000)
            assert engine.block_manager.all_free(), "a KV block is still held after every request finished"
            outputs |= {o.request_id: o.outputs[0] for o in engine.take_finished()}
    finally:
        engine.shutdown()
    return outputs, engine


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for req_id, out in want.items():
        mine = got[req_id]
        assert (mine.token_ids, mine.text, mine.finish_reason) == (out.token_ids, out.text, out.finish_reason), req_id
        assert (mine.logprobs is None) == (out.logprobs is None)
        for a, b in zip(mine.logprobs or (), out.logprobs or ()):
            assert list(a) == list(b)
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


@pytest.fixture(scope="module")
def plain_outputs(model_dir):
    return run(config(model_dir, None))[0]


def test_ngram_speculation_gives_the_outputs_of_plain_decoding(model_dir, plain_outputs):
    got, engine = run(config(model_dir, NGRAM))
    assert_same(got, plain_outputs)
    stats = engine.scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran


def test_speculation_under_chunked_prefill_preemption_and_prefix_hits(model_dir, plain_outputs):
    # Two rounds (the second finds the first's blocks), small steps and a cache too small for a round at once.
    got, engine = run(config(model_dir, NGRAM, max_num_batched_tokens=16, num_kv_blocks=32), rounds=2)
    assert_same({k: v for k, v in got.items() if k.startswith("0-")}, plain_outputs)
    assert_same({k.replace("1-", "0-", 1): v for k, v in got.items() if k.startswith("1-")}, plain_outputs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_cached_prompt_tokens > 0
    assert engine.scheduler.speculator.stats.num_accepted_tokens > 0


def test_speculation_at_tp2_over_grpc_gives_the_outputs_of_plain_decoding_at_tp1(model_dir, plain_outputs):
    from shardserve.api.local_executors import create_executor

    got, engine = run(config(model_dir, NGRAM, tensor_parallel_size=2), make_executor=create_executor)
    assert_same(got, plain_outputs)
    assert engine.stats().spec_num_accepted_tokens > 0


def test_keeping_every_draft_changes_the_outputs(model_dir, plain_outputs, monkeypatch):
    monkeypatch.setattr(spec_verify, "accepted_count", lambda drafts, samples: len(drafts))
    got, _ = run(config(model_dir, NGRAM))
    assert any(got[r].token_ids != plain_outputs[r].token_ids for r in plain_outputs)


def test_speculative_greedy_tokens_match_transformers(model_dir):
    from tests.hf_reference import assert_greedy_match, hf_greedy

    greedy = lambda i: SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # noqa: E731
    got, engine = run(config(model_dir, NGRAM), PROMPTS[:4], greedy)
    refs = hf_greedy(model_dir, PROMPTS[:4], 32)
    for i, ref in enumerate(refs):
        assert_greedy_match(got[f"0-{i}"].token_ids, ref)
    assert engine.scheduler.speculator.stats.num_accepted_tokens > 0
