"""The engine with n-gram speculation over the fake workers (tests/cluster/_fake_executor.py verifies drafts as a
worker does and checks every position's KV): drafts copied from the prompt are accepted, and a stop string, a stop
token or max_tokens landing inside a run of accepted drafts ends the request exactly where decoding one token at a
time would, the tokens after it dropped; every block is free afterwards."""

from __future__ import annotations

from _fake_executor import FakeExecutor
from _tiny_tokenizer import byte_level_bpe

from shardserve.cluster.admission import EncodedPrompt
from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig
from shardserve.proto.speculative import SpeculativeConfig

BS = 4
TEXT = " the quick brown fox jumps over the lazy dog STOP and runs far away into the woods"


def make_engine(speculative: bool = True, **config) -> tuple[Engine, list[int]]:
    tok = byte_level_bpe()
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3).to_json() if speculative else None
    cfg = EngineConfig(model="fake", block_size=BS, max_model_len=256, speculative_config=spec, **config)
    engine = Engine(cfg, FakeExecutor(64, BS, tok.get_vocab_size()), tok, [0], vocab_size=tok.get_vocab_size())
    return engine, tok.encode(TEXT).ids


def run(engine: Engine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            assert engine.block_manager.all_free()
            return deltas
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    raise AssertionError("engine did not finish")


def generate(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple:
    """The request's output when its "model" copies the prompt (the fake samples the prompt's tokens in order)."""
    engine.executor.script = {"r": prompt + [5] * 50}
    engine.admit("r", EncodedPrompt(TEXT, prompt), params)
    deltas = run(engine)
    out = engine.get_output("r").outputs[0]
    return out, deltas["r"], len(engine.executor.history["r"]) - len(prompt)


def test_drafts_copied_from_the_prompt_are_accepted_and_the_output_is_unchanged():
    plain, _ = make_engine(speculative=False)
    engine, prompt = make_engine()
    params = SamplingParams(temperature=0, max_tokens=30)
    want, _, _ = generate(plain, prompt, params)
    got, deltas, _ = generate(engine, prompt, params)
    assert got.token_ids == want.token_ids == prompt[:30] and got.text == want.text
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 10 and max(len(d.token_ids) for d in deltas) > 1
    assert engine.num_steps < plain.num_steps


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there():
    engine, prompt = make_engine()
    got, deltas, computed = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=60, stop=["STOP"]))
    assert got.text == " the quick brown fox jumps over the lazy dog " and got.finish_reason == "stop"
    assert computed > len(got.token_ids)  # the workers kept tokens past the stop: it landed inside a run
    assert "".join(d.text for d in deltas) == got.text and sum(len(d.token_ids) for d in deltas) == len(got.token_ids)


def test_a_stop_token_inside_an_accepted_run_is_the_last_token():
    engine, prompt = make_engine()
    stop = prompt[9]
    first = prompt.index(stop)
    got, _, computed = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop]))
    assert got.token_ids == prompt[: first + 1] and got.finish_reason == "stop" and got.stop_reason == stop
    assert computed > len(got.token_ids)


def test_max_tokens_caps_the_drafts_so_nothing_past_it_is_computed():
    engine, prompt = make_engine()
    got, _, computed = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=7))
    assert got.token_ids == prompt[:7] and got.finish_reason == "length" and computed == 7


def test_no_drafts_once_the_batch_reaches_disable_by_batch_size():
    tok = byte_level_bpe()
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2).to_json()
    cfg = EngineConfig(model="fake", block_size=BS, max_model_len=256, speculative_config=spec)
    engine = Engine(cfg, FakeExecutor(64, BS, tok.get_vocab_size()), tok, [0], vocab_size=tok.get_vocab_size())
    prompt = tok.encode(TEXT).ids
    other = prompt[::-1]  # not the same prompt: it would wait for the first one's blocks (a step of one request)
    engine.executor.script = {"a": prompt + [5] * 50, "b": other + [5] * 50}
    engine.admit("a", prompt, SamplingParams(temperature=0, max_tokens=20))
    engine.admit("b", other, SamplingParams(temperature=0, max_tokens=20))
    run(engine)
    assert engine.stats().spec_num_drafts == 0
    assert engine.get_output("a").outputs[0].token_ids == prompt[:20]
