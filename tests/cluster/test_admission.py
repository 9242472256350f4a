"""cluster/admission.py: prompts are encoded in one place and a request is checked once, whichever front end sends
it (LLM and the gRPC Generation service both admit through Engine.admit)."""

import grpc
import pytest
from _fake_executor import FakeExecutor

from shardserve.cluster import admission
from shardserve.cluster.admission import RequestLimits, check_request, encode_prompt
from shardserve.cluster.engine import Engine
from shardserve.cluster.generation_service import request_from_proto, status_of
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto import generation_pb2 as pb
from shardserve.proto.config import EngineConfig

VOCAB = 1000
BS = 4


class CharTokenizer:
    """One token per character; a chat template that wraps each message in its role."""

    chat_template = "{role}: {content}"
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def make_engine(tokenizer=None, num_blocks=8, max_model_len=32) -> Engine:
    config = EngineConfig(model="fake", block_size=BS, max_model_len=max_model_len)
    return Engine(config, FakeExecutor(num_blocks, BS, VOCAB), tokenizer, vocab_size=VOCAB)


def test_text_token_ids_and_chat_are_encoded_by_one_function():
    tok = CharTokenizer()
    assert encode_prompt("hi", tok) == ("hi", [ord("h"), ord("i")])
    assert encode_prompt([5, 6], tok) == (None, [5, 6])
    assert encode_prompt((5, 6), None) == (None, [5, 6])
    text, ids = encode_prompt([{"role": "user", "content": "hi"}], tok)
    assert text == "<user>hi<assistant>" and ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "prompt, tokenizer, message",
    [
        ("", CharTokenizer(), "empty"),
        ("hi", None, "no tokenizer"),
        ([{"role": "user", "content": "hi"}], None, "no chat template"),
        ([{"role": "wizard", "content": "hi"}], CharTokenizer(), "wizard"),
        ([{"role": "user", "content": 3}], CharTokenizer(), "string content"),
        (42, CharTokenizer(), "text, token ids or chat messages"),
    ],
)
def test_prompts_a_model_cannot_take_are_rejected_with_what_is_wrong(prompt, tokenizer, message):
    with pytest.raises(ValueError, match=message):
        encode_prompt(prompt, tokenizer)


def test_check_request_rejects_what_could_never_run():
    limits = RequestLimits(vocab_size=VOCAB, max_model_len=32, block_size=BS, num_kv_blocks=4)
    ok = SamplingParams(max_tokens=4)
    check_request([1] * 13, ok, limits)  # 16 stored positions: exactly 4 blocks
    bad = [
        ([], ok, "empty"),
        ([1, VOCAB], ok, r"\[0, 1000\)"),
        ([1, True], ok, "integers"),
        ([1], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        ([1] * 30, ok, "max_model_len"),
        ([1] * 14, ok, "KV blocks"),
        ([1], {"max_tokens": 4}, "SamplingParams"),
    ]
    for ids, params, message in bad:
        with pytest.raises(ValueError, match=message):
            check_request(ids, params, limits)


def test_max_tokens_none_is_the_rest_of_the_context_and_the_shared_params_stay_as_they_were():
    limits = RequestLimits(vocab_size=VOCAB, max_model_len=32, block_size=BS, num_kv_blocks=4)  # cache: 17 tokens
    rest = SamplingParams(max_tokens=None, min_tokens=2)
    assert check_request([1] * 10, rest, RequestLimits(VOCAB, 32, BS, 100)).max_tokens == 22  # max_model_len - 10
    assert check_request([1] * 10, rest, limits).max_tokens == 7  # 4 blocks of 4 hold 16 KV positions: 17 tokens
    assert rest.max_tokens is None and check_request([1] * 3, rest, limits).max_tokens == 14
    ok = SamplingParams(max_tokens=4)
    assert check_request([1] * 3, ok, limits) is ok
    for prompt_len in (16, 17):  # room for 1 token, fewer than min_tokens; none at all
        with pytest.raises(ValueError, match="leaves no room"):
            check_request([1] * prompt_len, rest, limits)


def test_each_admission_checks_the_request_once(monkeypatch):
    calls = []
    original = admission.check_request
    monkeypatch.setattr("shardserve.cluster.engine.check_request", lambda *a: calls.append(a) or original(*a))
    engine = make_engine(CharTokenizer())
    assert engine.admit("a", "hello", SamplingParams(max_tokens=4)).num_prompt_tokens == 5
    assert len(calls) == 1
    assert engine.get_output("a").prompt == "hello"


def _generate_request(**fields) -> pb.GenerateRequest:
    prompt = fields.pop("prompt")
    msg = pb.GenerateRequest(**fields)
    if isinstance(prompt, str):
        msg.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        msg.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
    else:
        msg.token_ids.ids.extend(prompt)
    return msg


# What the e2e test sends a live server (tests/e2e/test_cluster.py: INVALID_ARGUMENT for each), and the message.
BAD_REQUESTS = [
    (dict(prompt="hello", temperature=-1.0), "temperature"),
    (dict(prompt=""), "empty"),
    (dict(prompt="hello", max_tokens=10_000), "max_model_len"),
    (dict(prompt=[{"role": "wizard", "content": "hi"}]), "wizard"),
    (dict(prompt=[1, 2, 10**6]), "prompt token ids"),
    (dict(prompt="hello", top_p=0.0), "top_p"),
    (dict(prompt=[1] * 20, max_tokens=12), "KV blocks"),
    (dict(prompt="hello", stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(prompt="hello", logit_bias={VOCAB: 1.0}), "logit_bias"),
]


@pytest.mark.parametrize("fields, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_the_server_and_the_offline_api_reject_the_same_requests_the_same_way(fields, message):
    """The server maps a GenerateRequest by field names and admits it as LLM does: one check, one message."""
    engine = make_engine(CharTokenizer(), num_blocks=6, max_model_len=64)
    with pytest.raises(ValueError, match=message):  # the server: request_from_proto, then Engine.admit
        prompt, params, _ = request_from_proto(_generate_request(**dict(fields)))
        engine.admit("server", prompt, params)
    offline = dict(fields)
    prompt = offline.pop("prompt")
    with pytest.raises(ValueError, match=message):  # LLM.generate: SamplingParams, then Engine.admit
        engine.admit("offline", prompt, SamplingParams(**offline))
    assert not engine.has_unfinished()


def test_generate_request_maps_onto_sampling_params_by_field_name():
    msg = _generate_request(prompt="hi", temperature=0.0, top_k=5, seed=7, stop=["x", "y"], stop_token_ids=[3],
                            ignore_eos=True, logprobs=0, min_tokens=2, max_tokens=9)
    prompt, params, req_id = request_from_proto(msg)
    assert (prompt, req_id) == ("hi", None)
    assert params == SamplingParams(temperature=0.0, top_k=5, seed=7, stop=["x", "y"], stop_token_ids=[3],
                                    ignore_eos=True, logprobs=0, min_tokens=2, max_tokens=9)
    unset = request_from_proto(_generate_request(prompt=[1], request_id="r"))
    # unset optional fields: SamplingParams' defaults, but max_tokens: the rest of the context (None)
    assert unset[1] == SamplingParams(max_tokens=None) and unset[2] == "r"


# Requests whose refusal once repeated the whole offending value: past gRPC's 8 KB of metadata the status was lost
# (RESOURCE_EXHAUSTED "received metadata size exceeds ..."), the reason with it.
OVERSIZED = [
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias must be a dict of at most 1024 token ids", "1025"),
    (dict(stop=["stop"] * 4999 + [""]), "stop must be a non-empty string", "'' at index 4999 of 5000"),
    (dict(stop_token_ids=list(range(4999)) + [-1]), "stop_token_ids must be a list of token ids >= 0",
     "-1 at index 4999 of 5000"),
    (dict(temperature=float("nan"), stop=["x" * 100_000]), "temperature must be", "nan"),
]


@pytest.mark.parametrize("fields, reason, shown", OVERSIZED, ids=["logit_bias", "stop", "stop_token_ids", "nan"])
def test_a_refusal_of_a_large_request_names_the_entry_at_fault_in_a_short_message(fields, reason, shown):
    with pytest.raises(ValueError) as refused:
        request_from_proto(_generate_request(prompt="hello", **fields))
    code, message = status_of(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(reason) and shown in message, message
    assert len(message) < 200


def test_no_status_message_is_longer_than_a_kib_whatever_the_error_says():
    for error in (ValueError("bad " + "x" * 100_000), RuntimeError("é" * 100_000)):
        message = status_of(error)[1]
        assert len(message.encode()) <= 1024 and message.startswith(("bad xxx", "internal error: RuntimeError('éé"))
        assert message.endswith("bytes in all)")
