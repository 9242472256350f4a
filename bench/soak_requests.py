"""The requests of `shardserve bench soak`: what each kind sends and which endings are right for it.

Valid streams come from a fixed pool (greedy, seeded, with stop strings, of various lengths), so each one's tokens
can be compared with the pool's undisturbed reference; unseeded streams are checked for finishing only (their
tokens are random). Invalid requests are sent as raw GenerateRequest bytes (the client library would refuse some
before they reach the server), each with the one status it must get. Cancellations leave a stream after a few
deltas; deadlines give a long stream too little time (DEADLINE_EXCEEDED, or a result when it was fast enough).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpc

from shardserve.proto import generation_pb2 as pb

GENERATE = "/shardserve.v1.Generation/Generate"
TOPICS = ["the sea", "a lighthouse keeper", "prime numbers", "a small robot", "the moon", "an old library",
          "bread", "a mountain road", "rain in the city", "chess", "a lost key", "winter birds"]
LENGTHS = [1, 2, 4, 8, 8, 16, 16, 24, 32, 48]  # max_tokens of the pool's streams: mostly short, some longer
STOPS = [[" the"], ["."], [",", "!"], ["\n"]]

# kind -> share of the requests (the soak's mix)
MIX = {"greedy": 18, "seeded": 15, "stop": 10, "unseeded": 10, "cancel": 10, "deadline": 10,
       "bad-token-id": 3, "empty-prompt": 3, "too-long": 3, "negative-temperature": 3, "n-2": 2, "not-protobuf": 3,
       "invalid-utf8": 3, "prompt-over-bytes": 2, "over-request-bytes": 1, "unknown-abort": 2, "bad-logit-bias": 2}
EXPECTED = {"bad-token-id": "INVALID_ARGUMENT", "empty-prompt": "INVALID_ARGUMENT", "too-long": "INVALID_ARGUMENT",
            "negative-temperature": "INVALID_ARGUMENT", "n-2": "INVALID_ARGUMENT", "not-protobuf": "INVALID_ARGUMENT",
            "invalid-utf8": "INVALID_ARGUMENT", "prompt-over-bytes": "INVALID_ARGUMENT",
            "over-request-bytes": "RESOURCE_EXHAUSTED", "unknown-abort": "NOT_FOUND",
            "bad-logit-bias": "INVALID_ARGUMENT"}


@dataclass(frozen=True)
class Spec:
    """One valid stream of the pool (the same Spec always gives the same tokens, except unseeded ones)."""
    prompt: str | list[int]  # token ids when the model has no tokenizer
    max_tokens: int
    sampling: dict = field(default_factory=dict, hash=False)  # temperature, seed, stop, ignore_eos


@dataclass
class Limits:
    """What the invalid requests must exceed: the served model's and the server's limits."""
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int
    max_request_bytes: int


def make_pool(size: int, rng: random.Random, vocab_size: int | None = None) -> dict[str, list[Spec]]:
    """size streams for each checked kind (greedy, seeded, stop), and size unseeded ones. vocab_size: the model has
    no tokenizer; prompts are token ids below it, and stop strings become stop token ids."""
    def prompt(i: int) -> str | list[int]:
        text = f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (note {i}):"
        return text if vocab_size is None else [(b * 31 + i) % vocab_size for b in text.encode()[:8 + i % 24]]

    def stop(i: int) -> dict:
        if vocab_size is None:
            return {"stop": STOPS[i % len(STOPS)]}
        return {"stop_token_ids": [rng.randrange(vocab_size) for _ in range(8)]}

    pool: dict[str, list[Spec]] = {"greedy": [], "seeded": [], "stop": [], "unseeded": []}
    for i in range(size):
        n = LENGTHS[i % len(LENGTHS)]
        pool["greedy"].append(Spec(prompt(i), n, {"temperature": 0.0, "ignore_eos": i % 3 != 0}))
        pool["seeded"].append(Spec(prompt(i + 1000), n, {"temperature": 0.8, "top_p": 0.95,
                                                         "seed": rng.randrange(2**31), "ignore_eos": True}))
        pool["stop"].append(Spec(prompt(i + 2000), max(n, 16), {"temperature": [0.0, 0.7][i % 2],
                                                                "seed": rng.randrange(2**31), **stop(i)}))
        pool["unseeded"].append(Spec(prompt(i + 3000), n, {"temperature": 1.0, "ignore_eos": True}))
    return pool


def make_schedule(n: int, pool: dict[str, list[Spec]], rng: random.Random) -> list[tuple[str, int]]:
    """n (kind, index into the kind's pool) pairs drawn with MIX's shares."""
    kinds, weights = zip(*MIX.items())
    size = len(pool["greedy"])
    return [(kind, rng.randrange(size)) for kind in rng.choices(kinds, weights, k=n)]


def invalid_bytes(kind: str, limits: Limits) -> bytes:
    """The raw Generate request of an invalid kind."""
    if kind == "not-protobuf":
        return b"\xff\xff\xff\xff\xff\xff"  # field 31, wire type 7: no such wire type
    if kind == "invalid-utf8":
        return b"\x12\x03\xff\xfe\xfd"  # field 2 (text), 3 bytes that are not UTF-8
    if kind == "over-request-bytes":
        return pb.GenerateRequest(text="x" * (limits.max_request_bytes + 16), max_tokens=1).SerializeToString()
    request = {
        "bad-token-id": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, limits.vocab_size + 7]), max_tokens=2),
        "empty-prompt": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), max_tokens=2),
        "too-long": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 8), max_tokens=limits.max_model_len),
        "negative-temperature": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=2,
                                                           temperature=-0.5),
        "n-2": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=2, n=2),
        "bad-logit-bias": lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=2,
                                                     logit_bias={limits.vocab_size: 1.0, 5: 500.0}),
        "prompt-over-bytes": lambda: pb.GenerateRequest(text="word " * (limits.max_prompt_bytes // 5 + 2),
                                                        max_tokens=2),
    }[kind]()
    return request.SerializeToString()


async def send_invalid(channel: grpc.aio.Channel, kind: str, limits: Limits, client) -> str:
    """The status name an invalid request ended with ("OK" when it got a result: always wrong)."""
    try:
        if kind == "unknown-abort":
            await client.abort(f"soak-no-such-request-{random.randrange(2**62)}", timeout=120)
            return "OK"
        call = channel.unary_stream(GENERATE)(invalid_bytes(kind, limits), timeout=300)
        async for _ in call:
            pass
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name
