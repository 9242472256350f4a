"""The public face: LLM.generate / chat / stream, SamplingParams validation, admission errors, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with LLM() as engine:
        yield engine


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["The capital of France is", [504, 3458, 282], "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 3, 7]
    assert outputs[0].prompt == "The capital of France is"
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == [504, 3458, 282]
    assert len({o.request_id for o in outputs}) == 3
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert "Paris" in outputs[0].outputs[0].text
    assert llm.engine.block_manager.all_free()


def test_generate_takes_each_answer_in_one_delta_and_leaves_the_callers_params_alone(llm, monkeypatch):
    """generate reads no deltas: its requests are final_only (one delta each, at the end), on copies of the
    caller's params; the answers are those streaming gives."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    deltas = []
    step = llm.engine.step

    def recording_step():
        got = step()
        deltas.extend(got)
        return got

    monkeypatch.setattr(llm.engine, "step", recording_step)
    outputs = llm.generate(["The capital of France is", "Hello"], greedy, use_tqdm=False)
    monkeypatch.undo()
    assert greedy.final_only is False
    assert len(deltas) == 2 and all(d.finished and len(d.token_ids) == 6 for d in deltas)
    streamed = list(llm.stream("Hello", greedy))
    assert [t for d in streamed for t in d.token_ids] == outputs[1].outputs[0].token_ids
    assert len(streamed) > 1


def test_stop_string_ends_the_output_and_never_appears_in_it(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split()[1]  # a word from the middle of the greedy continuation
    cut = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert stop not in cut.outputs[0].text
    assert full.startswith(cut.outputs[0].text)


def test_eos_finishes_with_stop_and_min_tokens_holds_it_back(llm):
    chat = llm.apply_chat_template([{"role": "user", "content": "Say yes."}])
    short = llm.generate([chat], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "stop" and len(short.outputs[0].token_ids) < 200
    at_least = len(short.outputs[0].token_ids) + 5
    longer = llm.generate([chat], SamplingParams(temperature=0, max_tokens=200, min_tokens=at_least),
                          use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) >= len(short.outputs[0].token_ids) + 5


def test_chat_applies_the_template_and_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text


def test_stream_yields_deltas_that_add_up_to_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = list(llm.stream("Once upon a time", params))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    whole = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert "".join(d.text for d in deltas) == whole.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == whole.outputs[0].token_ids


@pytest.mark.parametrize(
    "field, value",
    [("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1), ("max_tokens", 0),
     ("min_p", 2.0), ("logprobs", 21), ("seed", -1), ("presence_penalty", 3.0), ("repetition_penalty", 0.0),
     ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [5]),
     ("logit_bias", {i: 1.0 for i in range(1025)})],
)
def test_invalid_sampling_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [dict(best_of=3), dict(n=2, best_of=2)])
def test_best_of_is_refused_as_not_supported(kwargs):
    import grpc

    from shardserve.client.clients import build_request
    from shardserve.cluster.generation_service import request_from_proto, status_of

    with pytest.raises(ValueError, match="not supported") as refused:
        SamplingParams(**kwargs)
    assert status_of(refused.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="not supported"):  # what the server does with a client's request
        request_from_proto(build_request("hi", None, kwargs))
    assert SamplingParams(n=1, best_of=1).n == 1


@pytest.mark.parametrize("n", [0, 17, -1, 2.0, True])
def test_n_outside_1_to_16_names_the_field(n):
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams(n=n)


def test_n_outputs_are_the_requests_seed_plus_i_would_give(llm):
    """n=3 with a seed: output i of each prompt is what one request with seed + i gives (LLM.generate sends n
    requests); outputs are indexed 0..n-1, prompts keep their order, and the cache is left empty."""
    import dataclasses

    prompts = ["The capital of France is", "Once upon a time"]
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    many = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in many] == prompts and params.n == 3 and params.seed == 11  # the caller's params kept
    for result, prompt in zip(many, prompts):
        assert [c.index for c in result.outputs] == [0, 1, 2]
        alone = [llm.generate(prompt, dataclasses.replace(params, n=1, seed=11 + i), use_tqdm=False)[0].outputs[0]
                 for i in range(3)]
        assert [c.token_ids for c in result.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in many[0].outputs}) > 1  # the seeds differ, so do the outputs (8 tokens)
    assert llm.engine.block_manager.all_free()


def test_a_request_of_n_outputs_is_refused_by_the_engine_and_so_over_grpc(llm):
    """The engine makes one output a request: n > 1 that did not come through LLM.generate (stream, add_request,
    a gRPC client's GenerateRequest) is INVALID_ARGUMENT, naming the way to ask for n outputs."""
    import grpc

    from shardserve.cluster.generation_service import status_of

    with pytest.raises(ValueError, match="a request makes one output") as refused:
        next(llm.stream("hi", SamplingParams(n=2)))
    assert status_of(refused.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="a request makes one output"):
        llm.engine.admit("n2", "hi", SamplingParams(n=2))
    assert llm.engine.block_manager.all_free()


def test_stop_strings_and_special_tokens_in_the_text_as_vllm(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split()[1]
    kept = SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate(["The capital of France is"], kept, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text.endswith(stop) and full.startswith(out.text)

    chat = llm.apply_chat_template([{"role": "user", "content": "Say yes."}])
    eos = llm.get_tokenizer().eos_token
    params = [SamplingParams(temperature=0, max_tokens=200),  # one batch: the same greedy tokens, four renderings
              SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False, include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=200, include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False)]
    plain, with_eos, skipped, eos_not_kept = (o.outputs[0] for o in llm.generate([chat] * 4, params, use_tqdm=False))
    assert plain.finish_reason == "stop" and eos not in plain.text
    assert with_eos.token_ids == plain.token_ids == skipped.token_ids == eos_not_kept.token_ids
    assert with_eos.text == plain.text + eos  # the eos token's own text, kept
    assert skipped.text == plain.text  # special: skipped
    assert eos_not_kept.text == plain.text  # eos ends it without include_stop_str_in_output


def test_outputs_have_vllms_shape(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert out.finished and out.prompt == "The capital of France is" and out.prompt_logprobs is None
    assert completion.index == 0 and completion.finished() and completion.finish_reason == "length"
    assert len(completion.logprobs) == len(completion.token_ids) == 4
    first = completion.logprobs[0][completion.token_ids[0]]
    assert first.rank == 1 and first.decoded_token == llm.get_tokenizer().decode([completion.token_ids[0]])
    assert completion.cumulative_logprob == pytest.approx(sum(
        lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)))


def test_bad_prompts_are_rejected_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], use_tqdm=False)
    too_long = SamplingParams(max_tokens=llm.config.max_model_len)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Hello there"], too_long, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.all_free()
    ok = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_a_prompt_or_sampling_params_of_the_wrong_type_is_a_type_error_saying_what_is_expected(llm):
    with pytest.raises(TypeError, match="prompts must be text, token ids, a prompt dict or a list of them; got int"):
        llm.generate(123, use_tqdm=False)
    with pytest.raises(TypeError, match=r"must be a SamplingParams.*got dict: write SamplingParams\(\*\*"):
        llm.generate("hi", {"max_tokens": 4}, use_tqdm=False)
    with pytest.raises(TypeError, match="got dict"):
        llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 4}], use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams; got dict"):
        next(llm.stream("hi", {"max_tokens": 4}))
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.all_free()


def test_request_needing_more_blocks_than_exist_is_rejected_at_admission(tiny_model):
    model_dir = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    with LLM(model=model_dir, num_kv_blocks=4, block_size=16, max_model_len=256) as small:
        with pytest.raises(ValueError, match="block"):
            small.generate([[1] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
        assert not small.engine.has_unfinished()


def test_seeded_sampling_is_the_same_alone_in_a_batch_after_preemption_and_at_tp2(tiny_model):
    model_dir = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    target = [5, 17, 33, 2, 99, 150, 7]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=40, ignore_eos=True)
    others = [[i + 1] * (10 + 7 * i) for i in range(6)]
    noise = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    with LLM(model=model_dir, max_model_len=256) as roomy:
        alone = roomy.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
        crowd = roomy.generate(others[:3] + [target] + others[3:], [noise] * 3 + [seeded] + [noise] * 3,
                               use_tqdm=False)[3].outputs[0].token_ids
    with LLM(model=model_dir, max_model_len=256, num_kv_blocks=12, block_size=8) as cramped:
        squeezed = cramped.generate(others + [target], [noise] * 6 + [seeded], use_tqdm=False)[6].outputs[0].token_ids
        assert cramped.engine.stats().num_preemptions > 0
    with LLM(model=model_dir, max_model_len=256, tensor_parallel_size=2) as tp2:
        sharded = tp2.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowd == squeezed == sharded


def test_dummy_weights_run_on_token_ids_without_a_tokenizer(tiny_model):
    model_dir = tiny_model("qwen3", num_heads=4, num_kv_heads=2)
    with LLM(model=model_dir, load_format="dummy", max_model_len=128) as dummy:
        out = dummy.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""


def test_cli_generate_streams_text(default_model_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "shardserve.cli.main", "generate", "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_cli_reports_a_bad_flag_value_as_an_error(default_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "shardserve.cli.main", "generate", "Hi", "--top-p", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2 and "top_p" in done.stderr


# ---- vLLM's prompt shapes, the engine seed, sliding windows: nothing silently wrong -----------------------------

def test_vllm_prompt_dicts_generate_what_their_text_or_ids_generate(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text, ids = "Hello, my name is", [504, 3458, 282]
    (by_text, by_ids) = llm.generate([text, ids], greedy, use_tqdm=False)
    one = llm.generate({"prompt": text}, greedy, use_tqdm=False)  # a single dict is one prompt, not its keys
    assert len(one) == 1 and one[0].prompt == text and one[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    listed = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in listed] == [by_text.outputs[0].token_ids, by_ids.outputs[0].token_ids]
    assert listed[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids == by_ids.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ({"text": "Hello"}, "unsupported key"),
        ({"prompt": "Hello", "prompt_token_ids": [1, 2]}, "exactly one"),
        ({"prompt": [1, 2]}, "must be text"),
        ({"prompt_token_ids": "Hello"}, "list of token ids"),
        ({"prompt": "Hello", "multi_modal_data": {}}, "multi_modal_data"),
    ],
)
def test_malformed_prompt_dicts_are_refused_by_name(llm, prompt, reason):
    with pytest.raises(ValueError, match=reason):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model):
    model_dir = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    prompts = [[5, 17, 33], [99, 150, 7, 8], [3, 4]]
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)  # no per-request seed

    def run(seed: int) -> list[list[int]]:
        with LLM(model=model_dir, max_model_len=128, seed=seed) as engine:
            return [o.outputs[0].token_ids for o in engine.generate(prompts, free, use_tqdm=False)]

    first, again, other = run(0), run(0), run(1)
    assert first == again
    assert first != other  # the seed is what made them equal (24 tokens at temperature 1: equal by chance ~never)
    assert len({tuple(t) for t in first}) == 3  # the requests of one run still draw different seeds


def test_sliding_window_model_is_refused_unless_requests_fit_the_window(tmp_path, tiny_model):
    import json
    import shutil

    from shardserve.settings.resolve import build_engine_config

    source = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    mistral = tmp_path / "mistral"
    shutil.copytree(source, mistral)
    config = json.loads((mistral / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (mistral / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"sliding-window attention over 64 tokens.*--max-model-len"):
        build_engine_config(model=str(mistral), max_model_len=128)
    assert build_engine_config(model=str(mistral), max_model_len=64).max_model_len == 64
    config["sliding_window"] = None  # Mistral v0.2+: full attention
    (mistral / "config.json").write_text(json.dumps(config))
    assert build_engine_config(model=str(mistral), max_model_len=128).max_model_len == 128


def test_version_is_the_distributions_and_python_m_runs_the_cli():
    from importlib.metadata import version

    import shardserve

    assert shardserve.__version__ == version("shardserve")
    done = subprocess.run([sys.executable, "-m", "shardserve", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"shardserve {shardserve.__version__}"


def test_get_tokenizer_is_the_engines_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    assert tokenizer.decode(tokenizer.encode("Paris", add_special_tokens=False)) == "Paris"
