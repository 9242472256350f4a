import pytest
from _fake_executor import FakeExecutor, expected_output
from _tiny_tokenizer import byte_level_bpe

from shardserve.cluster.admission import EncodedPrompt
from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.config import EngineConfig
from shardserve.cluster.outputs import Logprob

BS = 4
VOCAB = 1000


def make_engine(num_blocks=64, tokenizer=None, eos=(), vocab=VOCAB, **config) -> Engine:
    config.setdefault("max_model_len", 256)
    cfg = EngineConfig(model="fake", block_size=BS, **config)
    return Engine(cfg, FakeExecutor(num_blocks, BS, vocab), tokenizer, eos, vocab_size=vocab)


def run(engine: Engine, max_steps=1000) -> dict[str, list]:
    """Steps until done; returns every delta per request id."""
    deltas: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return deltas
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    raise AssertionError("engine did not finish")


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]
PROMPTS = {f"r{i}": PREFIX[: 4 + i % 5] + [100 + i] * (1 + i % 4) for i in range(10)}


@pytest.mark.parametrize(
    "setting",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=5),  # chunked prefill everywhere
        dict(num_blocks=8),  # too few blocks: preemption by recompute
        dict(num_blocks=8, max_num_batched_tokens=3, max_num_seqs=3),
    ],
    ids=["default", "no-prefix-cache", "tiny-budget", "few-blocks", "few-blocks-tiny-budget"],
)
def test_outputs_are_exact_whatever_the_batching_caching_or_preemption(setting):
    engine = make_engine(**setting)
    for i, (req_id, prompt) in enumerate(PROMPTS.items()):
        engine.admit(req_id, prompt, greedy(4 + i))
        if i == 2:
            engine.step()  # later arrivals can hit the prefix the first ones computed
    run(engine)
    outputs = {o.request_id: o for o in engine.take_finished()}
    for req_id, prompt in PROMPTS.items():
        o = outputs[req_id]
        assert o.outputs[0].token_ids == expected_output(prompt, 4 + int(req_id[1:]), VOCAB), req_id
        assert o.outputs[0].finish_reason == "length" and o.finished and o.prompt_token_ids == prompt
    assert engine.block_manager.all_free()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
    if setting.get("num_blocks") == 8:
        assert stats.num_preemptions > 0
    if setting.get("enable_prefix_caching", True):
        assert stats.num_cached_prompt_tokens > 0


def test_streamed_deltas_add_up_to_the_final_output():
    engine = make_engine(max_num_batched_tokens=6)
    engine.admit("a", [1, 2, 3, 4, 5, 6, 7], greedy(9, logprobs=1))
    engine.admit("b", [9], greedy(3))
    deltas = run(engine)
    for req_id, ds in deltas.items():
        out = engine.get_output(req_id)
        assert [d.finished for d in ds] == [False] * (len(ds) - 1) + [True]
        assert sum((d.token_ids for d in ds), []) == out.outputs[0].token_ids
        assert [d.num_generated for d in ds] == list(range(1, len(out.outputs[0].token_ids) + 1))
        assert ds[-1].finish_reason == "length" and ds[0].num_prompt_tokens == len(out.prompt_token_ids)
    lps = sum((d.logprobs for d in deltas["a"]), [])
    assert len(lps) == 9 and all(isinstance(lp, dict) and isinstance(lp[t], Logprob) for lp, t in
                                 zip(lps, engine.get_output("a").outputs[0].token_ids))
    assert engine.get_output("a").outputs[0].logprobs == lps and engine.get_output("b").outputs[0].logprobs is None


def test_abort_midway_frees_blocks_and_tells_the_workers():
    engine = make_engine(max_num_seqs=2)
    executor: FakeExecutor = engine.executor
    for name in "abc":
        engine.admit(name, [ord(name)] * 6, greedy(20))
    run_steps = [engine.step() for _ in range(3)]
    assert all(len(ds) == 2 for ds in run_steps)
    assert engine.abort("b") and engine.abort("c")  # b is running, c never left the queue
    assert not engine.abort("b") and not engine.abort("nope")
    deltas = run(engine)
    assert deltas["b"][0].finished and deltas["b"][0].finish_reason == "abort"
    assert deltas["c"][0].finish_reason == "abort" and deltas["c"][0].token_ids == []
    b = engine.get_output("b")
    assert b.outputs[0].finish_reason == "abort" and b.outputs[0].token_ids == expected_output([ord("b")] * 6, 3, VOCAB)
    assert executor.dropped_finished[0] == "b" and "c" not in executor.history  # c was never sent
    assert engine.get_output("a").outputs[0].token_ids == expected_output([ord("a")] * 6, 20, VOCAB)
    assert engine.block_manager.all_free()


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    prompt = [5]
    free_run = expected_output(prompt, 10, VOCAB)
    eos = free_run[2]  # the third generated token
    engine = make_engine(eos=[eos])
    engine.admit("eos", prompt, greedy(10))
    engine.admit("ignore", prompt, greedy(10, ignore_eos=True))
    engine.admit("min", prompt, greedy(10, min_tokens=3))
    engine.admit("stop-id", prompt, greedy(10, ignore_eos=True, stop_token_ids=[free_run[4]]))
    run(engine)
    assert (engine.get_output("eos").outputs[0].token_ids, engine.get_output("eos").outputs[0].finish_reason) == (free_run[:3], "stop")
    assert (engine.get_output("ignore").outputs[0].token_ids, engine.get_output("ignore").outputs[0].finish_reason) == (free_run, "length")
    minned = engine.get_output("min").outputs[0].token_ids
    assert minned == expected_output(prompt, 10, VOCAB, stop_ids=[eos], min_tokens=3)
    assert eos not in minned[:3] and minned[:2] == free_run[:2]
    assert engine.get_output("stop-id").outputs[0].token_ids == free_run[:5]
    assert engine.block_manager.all_free()


def test_a_stop_token_before_min_tokens_does_not_end_the_request():
    eos = 7
    engine = make_engine(eos=[eos])
    engine.executor.script = {"r": [eos, 1, eos, 2, eos, 3]}  # workers that ignored the min_tokens mask
    engine.admit("r", [5], greedy(6, min_tokens=3))
    run(engine)
    r = engine.get_output("r")
    assert (r.outputs[0].token_ids, r.outputs[0].finish_reason) == ([eos, 1, eos, 2, eos], "stop")


def test_stop_strings_and_eos_on_a_real_tokenizer():
    tok = byte_level_bpe()
    vocab = tok.get_vocab_size()
    engine = make_engine(tokenizer=tok, eos=[0], vocab=vocab)
    script = tok.encode(" héllo wörld 🙂 STOP here and more").ids
    k = next(i for i in range(1, len(script) + 1) if "STOP" in tok.decode(script[:i]))
    engine.executor.script = {"s": script, "eos": tok.encode(" ça va 日本").ids + [0, 5, 5], "len": script}
    prompt = tok.encode("the fox says").ids
    engine.admit("s", EncodedPrompt("the fox says", prompt), greedy(len(script), stop=["STOP"]))
    engine.admit("eos", prompt, greedy(30))
    engine.admit("len", prompt, greedy(6))
    deltas = run(engine)
    s = engine.get_output("s")
    assert s.outputs[0].text == " héllo wörld 🙂 " and s.outputs[0].finish_reason == "stop" and s.prompt == "the fox says"
    assert s.outputs[0].token_ids == script[:k]
    assert "".join(d.text for d in deltas["s"]) == s.outputs[0].text
    e = engine.get_output("eos")
    assert e.outputs[0].text == " ça va 日本" and e.outputs[0].finish_reason == "stop" and e.outputs[0].token_ids[-1] == 0
    assert "".join(d.text for d in deltas["eos"]) == e.outputs[0].text
    ln = engine.get_output("len")
    assert ln.outputs[0].text == tok.decode(script[:6]) and ln.outputs[0].finish_reason == "length"


def test_invalid_requests_are_rejected_and_leave_no_trace():
    engine = make_engine(num_blocks=4, max_model_len=64)
    bad = [
        ("e", [], greedy(2), "empty"),
        ("v", [1, VOCAB], greedy(2), "vocabulary|\\[0, 1000\\)"),
        ("n", [1, -1], greedy(2), "\\[0, 1000\\)"),
        ("f", [1.0], greedy(2), "integers"),
        ("l", [1] * 60, greedy(10), "max_model_len"),
        ("k", [1] * 16, greedy(8), "KV blocks"),
        ("s", [1], greedy(2, stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
        ("", [1], greedy(2), "request id"),
    ]
    for req_id, prompt, params, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.admit(req_id, prompt, params)
    assert not engine.has_unfinished()
    engine.admit("ok", [1, 2], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.admit("ok", [3], greedy(2))
    run(engine)
    with pytest.raises(ValueError, match="already in use"):  # its output has not been taken yet
        engine.admit("ok", [3], greedy(2))
    assert engine.pop_output("ok").outputs[0].token_ids == expected_output([1, 2], 2, VOCAB)
    assert not engine.has_request("ok")
    engine.admit("ok", [3], greedy(2))  # taken: the id is free again
    assert engine.has_request("ok")


def test_stats_follow_queues_steps_and_cache():
    engine = make_engine(max_num_seqs=1)
    for name in "abc":
        engine.admit(name, PREFIX + [ord(name)], greedy(2))
    s0 = engine.stats()
    assert (s0.num_waiting, s0.num_running, s0.num_steps) == (3, 0, 0)
    engine.step()
    s1 = engine.stats()
    assert (s1.num_waiting, s1.num_running, s1.num_steps, s1.num_kv_blocks_used) == (2, 1, 1, 3)
    run(engine)
    s = engine.stats()
    assert s.num_finished == 3 and s.num_generated_tokens == 6 and s.num_kv_blocks_used == 0
    assert s.num_cached_prompt_tokens == 16  # b and c each reuse a's two full prefix blocks
    assert s.num_kv_blocks_cached >= 2 and s.num_prompt_tokens == 27
    assert s.num_computed_tokens == 27 - 16 + 3  # prefills minus hits, plus one decode each
