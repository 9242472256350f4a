"""The workers' grammar matchers (worker/grammar_matchers.py) on the default model's vocabulary, without a model:
random logits, masked, then the argmax taken as the sampled token. Proves: only tokens the grammar allows survive
the mask and the result parses; unconstrained rows are untouched; a request sent anew (resumed after preemption)
catches up from its generated tokens to the same mask; a finished grammar leaves its row to end on a stop token."""

from __future__ import annotations

import json

import pytest
import torch

from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan
from shardserve.worker.grammar_matchers import GrammarMatchers
from shardserve.worker.sampling_row import SamplingRow

EOS = 2
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
                     "required": ["ok", "n"], "additionalProperties": False})


@pytest.fixture(scope="module")
def vocab(default_model_dir):
    from transformers import AutoTokenizer

    return default_model_dir, AutoTokenizer.from_pretrained(default_model_dir)


def _spec(kind: str, text: str) -> SamplingSpec:
    return SamplingSpec(grammar_kind=kind, grammar=text, stop_token_ids=[EOS])


def _generate(matchers: GrammarMatchers, specs: list[SamplingSpec], steps: int, seed: int = 0):
    """Greedy over random logits, every row masked by its grammar: (token lists, logits of the last step)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [[1] for _ in specs]  # a one-token prompt each
    logits = None
    for _ in range(steps):
        rows = [SamplingRow(spec, ids, 1) for spec, ids in zip(specs, tokens)]
        logits = torch.randn(len(specs), matchers.vocab_size, generator=gen)
        matchers.mask(logits, [f"r{i}" for i in range(len(specs))], rows)
        for ids, token in zip(tokens, logits.argmax(1).tolist()):
            if ids[-1] != EOS:
                ids.append(token)
    return tokens, logits


def test_only_what_the_grammar_allows_survives_the_mask(vocab):
    folder, tokenizer = vocab
    matchers = GrammarMatchers(folder, 49152)
    specs = [_spec("json", SCHEMA), _spec("choice", '["alpha", "beta gamma"]'), SamplingSpec(),
             _spec("regex", "[0-9]{3}-[a-z]{2}")]
    tokens, _ = _generate(matchers, specs, 40)
    texts = [tokenizer.decode(ids[1:-1]) for ids in tokens]
    assert all(ids[-1] == EOS for i, ids in enumerate(tokens) if i != 2), texts  # each grammar completed
    parsed = json.loads(texts[0])
    assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool) and parsed["n"] in (1, 22, 333)
    assert texts[1] in ("alpha", "beta gamma")
    assert len(texts[3]) == 6 and texts[3][:3].isdigit() and texts[3][3] == "-" and texts[3][4:].isalpha()
    assert matchers.last_mask_s > 0


def test_unconstrained_rows_keep_their_logits(vocab):
    matchers = GrammarMatchers(vocab[0], 49152)
    logits = torch.randn(3, 49152)
    before = logits.clone()
    rows = [SamplingRow(SamplingSpec(), [1], 1), SamplingRow(_spec("regex", "x+"), [1], 1),
            SamplingRow(SamplingSpec(temperature=1.0), [1, 5], 1)]
    matchers.mask(logits, ["a", "b", "c"], rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept and len(kept) < 200 and all("x" in vocab[1].decode([t]) for t in kept)


def test_a_request_sent_anew_catches_up_from_its_generated_tokens(vocab):
    spec = _spec("json", SCHEMA)
    stepped = GrammarMatchers(vocab[0], 49152)
    tokens, _ = _generate(stepped, [spec], 6, seed=3)
    # the same request on a fresh rank (or resumed after preemption): one mask call with 6 generated tokens
    fresh = GrammarMatchers(vocab[0], 49152)
    logits_a, logits_b = torch.zeros(1, 49152), torch.zeros(1, 49152)
    fresh.mask(logits_a, ["r0"], [SamplingRow(spec, tokens[0], 1)])
    stepped.mask(logits_b, ["r0"], [SamplingRow(spec, tokens[0], 1)])
    assert torch.equal(torch.isfinite(logits_a), torch.isfinite(logits_b))
    # dropped with the plan that resends it: its matcher starts over and catches up the same way
    stepped.drop(StepPlan(2, new_requests=[NewRequest("r0", tokens[0], 1, 0, [0], spec)]))
    logits_c = torch.zeros(1, 49152)
    stepped.mask(logits_c, ["r0"], [SamplingRow(spec, tokens[0], 1)])
    assert torch.equal(torch.isfinite(logits_c), torch.isfinite(logits_a))


def test_a_completed_grammar_allows_only_its_stop_tokens_then_nothing_more_is_masked(vocab):
    matchers = GrammarMatchers(vocab[0], 49152)
    spec = _spec("choice", '["alpha"]')
    ids = [1] + vocab[1].encode("alpha", add_special_tokens=False)
    logits = torch.zeros(1, 49152)
    matchers.mask(logits, ["r"], [SamplingRow(spec, ids, 1)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    logits = torch.zeros(1, 49152)  # the stop token sampled: the row ends (a step late under async scheduling)
    matchers.mask(logits, ["r"], [SamplingRow(spec, ids + [EOS], 1)])
    assert torch.isfinite(logits).all()
