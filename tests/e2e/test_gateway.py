"""The OpenAI-compatible HTTP gateway as users meet it: the real `openai` package against `shardserve serve
--http-port --http-workers 2` (a separate process joining the session's Ray on loopback, the default model at TP=1
on CPU; its gateway is a thread of it and one more process on the port). Status codes, metadata and the standalone command, against a fake upstream: test_gateway_fake_upstream.py.

Proves: /v1/models lists GetModelInfo's name; greedy completions and chat through the gateway equal the gRPC
client's output, streamed or not; token-id prompts, several prompts, stop strings, logprobs, seeds and usage
(stream_options.include_usage) map onto the gRPC request; invalid requests get 400 naming the field (ours and the
server's INVALID_ARGUMENT) and unsupported fields 400, n choices as n seeded requests, an unknown model 404; a client that disconnects
mid-stream frees its KV blocks on the server; SIGTERM drains (health 503) and stops the gateway.
"""

from __future__ import annotations

import queue
import re
import signal
import time

import grpc
import httpx
import openai
import pytest

from shardserve.client.clients import Client
from shardserve.gateway.app import GatewayThread
from shardserve.proto import generation_pb2 as pb
from tests.e2e.test_serve_cli import ServeProcess, serve_default_model

GATEWAY_READY = re.compile(r"shardserve gateway ready: (http://\S+/v1)")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(ray_session, default_model_dir):
    """(serve process, gRPC address, gateway base URL)."""
    server = serve_default_model(ray_session, default_model_dir, "--drain-timeout", "30", "--http-port", "0",
                                 "--http-workers", "2")  # a thread of the serve process and one more process
    try:
        address = server.wait_ready(180)
        deadline = time.monotonic() + 30
        while not (match := GATEWAY_READY.search(_next_line(server, deadline))):
            pass
        yield server, address, match.group(1)
    finally:
        server.stop()


def _next_line(server: ServeProcess, deadline: float) -> str:
    while time.monotonic() < deadline:
        try:
            return server.stdout.get(timeout=0.5)
        except queue.Empty:
            assert server.proc.poll() is None, f"serve exited:\n{''.join(server.stderr)[-3000:]}"
    raise AssertionError("no gateway ready line")


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    client = openai.OpenAI(base_url=served[2], api_key="not-checked-yet", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(served) -> Client:
    with Client(served[1], timeout=120) as client:
        yield client


def _wait_idle(client: Client, timeout_s: float = 30) -> pb.ServerStats:
    deadline = time.monotonic() + timeout_s
    while (stats := client.server_stats()).num_running or stats.num_waiting or stats.kv_blocks_used:
        assert time.monotonic() < deadline, f"the server still holds requests: {stats}"
        time.sleep(0.02)
    return stats


def test_models_lists_the_name_get_model_info_reports(oai, grpc_client):
    models = oai.models.list().data
    assert [m.id for m in models] == [grpc_client.model_info().model]
    card = oai.models.retrieve(models[0].id)  # GET /v1/models/{id}
    assert card.id == models[0].id and card.model_dump()["max_model_len"] == grpc_client.model_info().max_model_len
    for unknown in ("gpt-4", "org/some-model"):
        with pytest.raises(openai.NotFoundError) as error:
            oai.models.retrieve(unknown)
        assert error.value.body["code"] == "model_not_found" and unknown in error.value.message


def test_greedy_completion_equals_the_grpc_clients_output_streamed_or_not(oai, grpc_client):
    expected = grpc_client.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    got = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, temperature=0, max_tokens=12,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text and "Paris" in got.choices[0].text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    assert got.usage.total_tokens == expected.usage.prompt_tokens + 12
    chunks = list(oai.completions.create(prompt=PROMPT, model=got.model, temperature=0, max_tokens=12, stream=True,
                                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_greedy_chat_equals_the_grpc_clients_chat_streamed_or_not(oai, grpc_client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    expected = grpc_client.chat(messages, temperature=0, max_tokens=10)
    model = oai.models.list().data[0].id
    got = oai.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=10)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == expected.text
    assert got.usage.completion_tokens == expected.usage.completion_tokens
    assert got.choices[0].finish_reason == expected.finish_reason
    chunks = list(oai.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=10,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == expected.usage.completion_tokens
    assert usage.usage.prompt_tokens == expected.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(oai, grpc_client):
    """OpenAI's default for chat: no limit but the context. The answer ends by itself ("stop"), well within it."""
    got = oai.chat.completions.create(model=oai.models.list().data[0].id, temperature=0,
                                      messages=[{"role": "user", "content": "What is 2+2? Answer with one number."}])
    assert got.choices[0].finish_reason == "stop" and "4" in got.choices[0].message.content
    assert got.usage.completion_tokens > 0


def test_token_id_prompts_and_several_prompts_give_one_choice_each(oai, grpc_client, default_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(PROMPT, add_special_tokens=False)
    reference = grpc_client.generate(PROMPT, temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.text
    model = oai.models.list().data[0].id
    by_ids = oai.completions.create(model=model, prompt=ids, temperature=0, max_tokens=6,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert by_ids.choices[0].text == expected and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].token_ids == reference.token_ids  # vLLM's extension: the output's ids too
    batch = oai.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"], temperature=0, max_tokens=6,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == expected
    assert batch.usage.completion_tokens == 12
    chunks = list(oai.completions.create(model=model, prompt=[ids, ids], temperature=0, max_tokens=6, stream=True,
                                         extra_body={"ignore_eos": True}))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == expected


def test_stop_strings_end_the_text_before_them(oai, grpc_client):
    full = grpc_client.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True).text  # " Paris.\n\n..."
    assert "." in full
    got = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, temperature=0, max_tokens=12,
                                 stop=["."])
    assert got.choices[0].text == full.split(".")[0] and got.choices[0].finish_reason == "stop"


def test_logprobs_of_completions_and_chat(oai):
    model = oai.models.list().data[0].id
    got = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and top[token] == pytest.approx(logprob)  # greedy: the best is taken
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert bytes(content[0].bytes).decode() == content[0].token
    streamed = list(oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0, max_tokens=4, logprobs=True, top_logprobs=3,
                                                stream=True))
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_a_seed_makes_sampling_repeatable_and_equal_to_the_grpc_clients(oai, grpc_client):
    model = oai.models.list().data[0].id
    texts = {oai.completions.create(model=model, prompt="Once upon a time", temperature=1.0, seed=1234,
                                    max_tokens=10).choices[0].text for _ in range(2)}
    assert texts == {grpc_client.generate("Once upon a time", temperature=1.0, seed=1234, max_tokens=10).text}


def test_invalid_requests_get_400_naming_the_field(oai):
    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as error:  # the server's INVALID_ARGUMENT, with its reason
        oai.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert error.value.status_code == 400 and "temperature" in error.value.message
    assert error.value.body["param"] == "temperature"
    assert error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as error:  # a field OpenAI does not have
        oai.completions.create(model=model, prompt=PROMPT, extra_body={"frobnicate": 1})
    assert error.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as error:  # shapes pydantic refuses
        oai.completions.create(model=model, prompt=[[1, 2], "text"])
    assert error.value.body["param"] == "prompt" and "token ids" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    assert error.value.body["param"] == "messages.0.role"
    for field, value in (("tools", [{"type": "retrieval"}]), ("logit_bias", {"one": 5}),
                         ("response_format", {"type": "yaml"})):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                        **{field: value})
        assert error.value.body["param"] == field
    # harmless OpenAI fields are accepted and ignored
    ok = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    user="someone", metadata={"k": "v"}, store=False)
    assert ok.usage.completion_tokens <= 2


OVERSIZED = [  # once refused with the whole value in the message: past gRPC's 8 KB of metadata the status was lost
    ({"logit_bias": {str(t): 1.0 for t in range(1025)}}, "logit_bias", "at most 1024"),
    ({"stop": ["stop"] * 4999 + [""]}, "stop", "'' at index 4999 of 5000"),
    ({"stop_token_ids": list(range(4999)) + [-1]}, "stop_token_ids", "-1 at index 4999 of 5000"),
]


@pytest.mark.parametrize("fields, param, says", OVERSIZED, ids=[p for _, p, _ in OVERSIZED])
def test_a_large_invalid_field_keeps_its_status_and_reason_over_grpc_and_http(oai, grpc_client, fields, param, says):
    grpc_fields = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
    with pytest.raises(grpc.RpcError) as refused:
        grpc_client.generate(PROMPT, max_tokens=1, **grpc_fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert refused.value.details().startswith(param) and says in refused.value.details()
    with pytest.raises(openai.BadRequestError) as error:
        oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=1, extra_body=fields)
    assert error.value.body["param"] == param and says in error.value.message


def test_a_token_id_past_the_vocabulary_or_past_int32_is_a_400_on_prompt(oai):
    """The server's refusal (past the vocabulary) and the gateway's (past what the request holds) name one param."""
    for ids in ([1, 2, 10**6], [1, 2, 2**40]):
        with pytest.raises(openai.BadRequestError) as error:
            oai.completions.create(model=oai.models.list().data[0].id, prompt=ids, max_tokens=1)
        assert error.value.body["param"] == "prompt" and "prompt token ids must be integers in" in error.value.message


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_prompt_too_long_for_the_context_is_400_context_length_exceeded(oai, chat):
    """OpenAI's answer to a request that does not fit the context: 400 invalid_request_error, code
    context_length_exceeded, param naming the prompt ("messages" for a chat), which clients act on."""
    model = oai.models.list().data[0]
    max_model_len = model.model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as refused:
        if chat:
            oai.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=max_model_len)
        else:
            oai.completions.create(model=model.id, prompt="hi", max_tokens=max_model_len)
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == ("messages" if chat else "prompt")
    assert "exceeds max_model_len" in refused.value.message

def test_logit_bias_forces_and_bans_tokens(oai, grpc_client):
    """logit_bias (OpenAI's: token id strings -> [-100, 100]) reaches the sampler: +100 on a token makes greedy
    decoding pick it every step, -100 on greedy's first token makes it pick another, sampled or not; a bias
    out of range or on a token past the vocabulary is a 400 naming the field."""
    model = oai.models.list().data[0].id
    plain = grpc_client.generate(PROMPT, temperature=0, max_tokens=4, ignore_eos=True)
    forced = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=4, logit_bias={"42": 100},
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.choices[0].token_ids == [42] * 4 != plain.token_ids
    first = str(plain.token_ids[0])
    for temperature in (0.0, 0.7):
        banned = oai.completions.create(model=model, prompt=PROMPT, temperature=temperature, seed=3, max_tokens=1,
                                        logit_bias={first: -100}, extra_body={"return_token_ids": True})
        assert banned.choices[0].token_ids != plain.token_ids[:1]
    streamed = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                           max_tokens=3, logit_bias={"42": 100}, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [t for c in streamed if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])] == [42] * 3
    for bias in ({"42": 101}, {"999999999": 1}):
        with pytest.raises(openai.BadRequestError) as error:
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=1, logit_bias=bias)
        assert "logit_bias" in error.value.message and error.value.body["param"] == "logit_bias"


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(oai, grpc_client):
    """echo (completions): the text is the prompt then the output; with logprobs the prompt's tokens come first
    (the first with logprob None), their logprobs the server's prompt_logprobs, the output's text_offset counting
    from the prompt's start; max_tokens 0 gives the prompt alone (what evaluation harnesses ask for), no
    completion tokens; streamed, the first chunk carries the prompt."""
    model = oai.models.list().data[0].id
    ref = grpc_client.generate(PROMPT, temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    assert ref.prompt_text is None and grpc_client.generate(PROMPT, max_tokens=1, echo=True).prompt_text == PROMPT
    prompt_lps = [next(iter(p.values())) for p in ref.prompt_logprobs[1:]]
    echoed = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=1,
                                    extra_body={"ignore_eos": True})
    choice = echoed.choices[0]
    assert choice.text == PROMPT + ref.text
    lp = choice.logprobs
    n = len(ref.prompt_logprobs)
    assert "".join(lp.tokens[:n]) == PROMPT and len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([p.logprob for p in prompt_lps], abs=1e-6)
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset[n] == len(PROMPT) and echoed.usage.completion_tokens == 3
    only = oai.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.tokens == lp.tokens[:n] and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-6)
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + ref.text
    streamed_only = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                                stream=True))
    assert "".join(c.choices[0].text for c in streamed_only if c.choices) == PROMPT
    tokens = [t for c in streamed_only if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens[:n]
    with pytest.raises(openai.BadRequestError) as error:  # max_tokens 0 without echo: nothing to answer
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in error.value.message


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(oai, grpc_client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's): none for a prompt the server has not seen, whole
    blocks of it when the same prompt comes again, streamed (include_usage) or not; the gRPC client's
    usage.cached_prompt_tokens says the same."""
    model = oai.models.list().data[0].id
    prompt = "A prompt seen once before: " + " ".join(f"word{i}" for i in range(120))
    first = oai.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = oai.completions.create(model=model, prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    block = grpc_client.model_info().block_size
    assert 0 < cached < again.usage.prompt_tokens and cached % block == 0
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert grpc_client.generate(prompt, max_tokens=2).usage.cached_prompt_tokens == cached


def test_n_choices_are_the_seeded_requests_seed_plus_i(oai):
    """n=3 with a seed: choice i is what one choice with seed + i gives (each is a request of its own on the
    server); the prompt counts once in the usage; greedy choices are all the same."""
    model = oai.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a colour."}]
    many = oai.chat.completions.create(model=model, messages=messages, n=3, seed=7, temperature=1.0, max_tokens=8)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [oai.chat.completions.create(model=model, messages=messages, seed=7 + i, temperature=1.0, max_tokens=8)
             for i in range(3)]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    greedy = oai.completions.create(model=model, prompt=PROMPT, n=2, temperature=0, max_tokens=6)
    assert greedy.choices[0].text == greedy.choices[1].text
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=model, n=17, messages=messages)
    assert error.value.body["param"] == "n" and "n must be an integer in [1, 16]" in error.value.message


def test_vllms_extra_fields_map_onto_the_engine_and_unsupported_ones_are_400_naming_them(served, grpc_client):
    """include_stop_str_in_output, skip_special_tokens, prompt_logprobs and stop_reason in the choice, as vLLM's
    server has them, equal to the gRPC client's answer; priority 0 is accepted, others refused by name, as is a
    field the server does not know; /version and /ping answer."""
    base = served[2]
    root = base.removesuffix("/v1")

    def complete(**fields) -> httpx.Response:
        return httpx.post(f"{base}/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields},
                          timeout=120)

    kept = complete(stop=[" Paris"], include_stop_str_in_output=True, priority=0).json()["choices"][0]
    assert kept["text"].endswith(" Paris") and kept["stop_reason"] == " Paris" and kept["finish_reason"] == "stop"
    dropped = complete(stop=[" Paris"]).json()["choices"][0]
    assert not dropped["text"].endswith("Paris") and dropped["stop_reason"] == " Paris"
    ids = grpc_client.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    by_id = complete(stop_token_ids=[ids[2]]).json()["choices"][0]
    assert by_id["stop_reason"] == ids[2] and by_id["finish_reason"] == "stop"  # a token id: a number, as vLLM's
    assert complete().json()["choices"][0]["stop_reason"] is None  # length
    raw = complete(skip_special_tokens=False).json()["choices"][0]["text"]
    assert raw == grpc_client.generate(PROMPT, max_tokens=8, temperature=0, skip_special_tokens=False).text
    reply = complete(prompt_logprobs=1, max_tokens=1).json()
    positions = reply["choices"][0]["prompt_logprobs"]
    assert len(positions) == reply["usage"]["prompt_tokens"] and positions[0] is None
    assert all(1 <= len(p) <= 2 and all("logprob" in e for e in p.values()) for p in positions[1:])
    for fields, param in (({"priority": 1}, "priority"), ({"no_such_field": 1}, "no_such_field"),
                          ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        refused = complete(**fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    from shardserve import __version__

    assert httpx.get(f"{root}/version", timeout=30).json() == {"version": __version__}
    assert httpx.get(f"{root}/ping", timeout=30).status_code == 200
    assert httpx.post(f"{root}/ping", timeout=30).status_code == 200


def test_an_unknown_model_gets_404(oai):
    with pytest.raises(openai.NotFoundError) as error:
        oai.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"


def test_a_client_that_disconnects_mid_stream_frees_its_blocks_on_the_server(oai, grpc_client):
    _wait_idle(grpc_client)
    stream = oai.completions.create(model=oai.models.list().data[0].id, prompt="Tell me a long story", max_tokens=300,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stats = grpc_client.server_stats()
    assert stats.num_running == 1 and stats.kv_blocks_used > 0  # still generating: the client has not left yet
    aborted = stats.requests_aborted
    stream.close()
    stats = _wait_idle(grpc_client)
    assert stats.requests_aborted == aborted + 1
    # Each gateway process counts its own, and each new connection lands on one of the two: ask until the one that
    # served the stream answers.
    deadline = time.monotonic() + 60
    while not re.search(r"shardserve:gateway_client_disconnects_total ([1-9])",
                        httpx.get(str(oai.base_url).removesuffix("/v1/") + "/metrics").text):
        assert time.monotonic() < deadline, "no gateway process counted the disconnect"


def test_a_second_gateway_with_a_deadline_answers_504_and_the_server_frees_the_request(served, grpc_client):
    gateway = GatewayThread(served[1], "127.0.0.1", 0, request_timeout_s=0.5)
    try:
        with openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as error:
                client.completions.create(model=client.models.list().data[0].id, prompt="Tell me a long story",
                                          max_tokens=300, extra_body={"ignore_eos": True})
            assert error.value.status_code == 504 and error.value.body["code"] == "deadline_exceeded"
        _wait_idle(grpc_client)
    finally:
        gateway.stop()


def test_sigterm_drains_health_turns_503_and_the_gateway_stops_with_serve(served):
    """The last test of the served server: it stops it."""
    server, _, base = served
    root = base.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    # a live stream (longer than the 30 s drain could wait for) keeps the drain open: the gateway must answer health
    # while it lasts
    model = httpx.get(f"{base}/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as live:
        lines = live.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # admitted and under way
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (reply := _get(f"{root}/health")) is not None and reply.status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert reply is not None, "the gateway vanished while a stream was still draining"
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "service_unavailable_error"
    # leaving the stream aborts its request: the drain ends, and serve with it
    assert server.proc.wait(60) == 0
    assert _get(f"{root}/health") is None  # nothing listens there any more


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None

