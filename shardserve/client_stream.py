"""The client's streams: a Generate call's messages folded into deltas and a GenerationResult, and resuming a stream
that broke with UNAVAILABLE (shardserve/client.py's module docstring says when and why that is exact)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc

from shardserve.cluster.outputs import Logprob, PositionLogprobs
from shardserve.proto import generation_pb2 as pb

RESUME_BACKOFF_S = (0.2, 2.0)  # the first wait between resume tries, and the longest
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamDelta:
    text: str  # may be "" while a multi-byte character is incomplete
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None  # one per token id when asked for
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first delta, when asked for


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    usage: Usage
    logprobs: list[PositionLogprobs] | None  # one per generated token when asked for
    replica: str  # the engine replica that served it
    stop_reason: str | None = None  # with "stop": the stop string or user stop token id that matched (None: EOS)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # one per prompt token (None first) when asked for


def _logprobs(entries) -> list[PositionLogprobs]:
    """TokenLogprob messages -> vLLM's dicts, as LLM returns them: the token first, then the top N not already in."""
    out = []
    for lp in entries:
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, lp.text)}
        for rank, top in enumerate(lp.top_logprobs, start=1):
            d.setdefault(top.token_id, Logprob(top.logprob, rank, top.text))
        out.append(d)
    return out


class _Collector:
    """Folds a Generate stream's messages into deltas and, at the end, a GenerationResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.prompt_tokens = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.result: GenerationResult | None = None

    def feed(self, msg: pb.GenerateResponse) -> StreamDelta | None:
        kind = msg.WhichOneof("kind")
        if kind == "started":
            self.request_id, self.prompt_tokens = msg.started.request_id, msg.started.prompt_token_count
        elif kind == "delta":
            lps = _logprobs(msg.delta.logprobs) if msg.delta.logprobs else None
            if lps is not None:
                self.logprobs = (self.logprobs or []) + lps
            prompt_lps = None
            if msg.delta.prompt_logprobs:
                prompt_lps = self.prompt_logprobs = [None, *_logprobs(msg.delta.prompt_logprobs)]
            self.text.append(msg.delta.text)
            self.token_ids += msg.delta.token_ids
            return StreamDelta(msg.delta.text, list(msg.delta.token_ids), lps, prompt_lps)
        elif kind == "finished":
            f = msg.finished
            self.result = GenerationResult(
                request_id=self.request_id,
                text="".join(self.text),
                token_ids=self.token_ids,
                finish_reason=_FINISH.get(f.finish_reason),
                usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens),
                logprobs=self.logprobs,
                replica=f.replica,
                stop_reason=f.stop_reason or None,
                prompt_logprobs=self.prompt_logprobs,
            )
        return None


def _resumable(sampling: dict, resume: bool | None) -> bool:
    """resume=None: greedy (temperature 0) or seeded requests, whose tokens do not depend on where they resume."""
    if resume is not None:
        return resume
    return sampling.get("temperature") == 0 or sampling.get("seed") is not None


class _StreamState:
    """What a blocking and an async stream share: the call and what its messages have told so far. reopen(tokens)
    starts the request again with the tokens received so far (None: no resuming)."""

    def __init__(self, call, reopen=None, resume_timeout_s: float = 120.0) -> None:
        self._call = call
        self._collector = _Collector()
        self._reopen = reopen
        self._resume_timeout_s = resume_timeout_s
        self._resume_until: float | None = None  # while resuming: when to give up
        self._resume_wait_s = RESUME_BACKOFF_S[0]
        self.num_resumes = 0  # how many times the stream was sent again

    def _next_try_s(self, error: grpc.RpcError) -> float | None:
        """After a broken call: seconds to wait before sending the request again, or None to raise the error."""
        import time

        if self._reopen is None or error.code() != grpc.StatusCode.UNAVAILABLE or self._collector.result is not None:
            return None
        if not self._collector.request_id:  # refused before it was admitted (starting, draining): not a break
            return None
        now = time.monotonic()
        if self._resume_until is None:
            self._resume_until = now + self._resume_timeout_s
        if now >= self._resume_until:
            return None
        wait_s, self._resume_wait_s = self._resume_wait_s, min(2 * self._resume_wait_s, RESUME_BACKOFF_S[1])
        return min(wait_s, self._resume_until - now)

    def _resumed(self) -> None:
        """A message came on a resumed call: the resume worked, the next break starts a new budget."""
        if self._resume_until is not None:
            self._resume_until, self._resume_wait_s = None, RESUME_BACKOFF_S[0]

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    @property
    def result(self) -> GenerationResult | None:
        return self._collector.result

    def cancel(self) -> None:
        """Ends the stream; the server aborts the request and frees its cache blocks."""
        self._call.cancel()


class Stream(_StreamState):
    """Iterates a request's deltas. request_id is known after the first delta (or call .wait_started());
    .result is set once the stream has finished."""

    def __iter__(self) -> Iterator[StreamDelta]:
        import time

        while True:
            try:
                for msg in self._call:
                    self._resumed()
                    delta = self._collector.feed(msg)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as error:
                wait_s = self._next_try_s(error)
                if wait_s is None:
                    raise
                time.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                self.num_resumes += 1
                self._call = self._reopen(list(self._collector.token_ids))

    def wait_started(self) -> str:
        """Reads up to the Started message; returns the request id."""
        while not self._collector.request_id:
            self._collector.feed(next(self._call))
        return self._collector.request_id


class AsyncStream(_StreamState):
    """Async-iterates a request's deltas; the same attributes as Stream. Leaving the loop early (break, an
    exception, a cancelled task) cancels the call, and the server aborts the request."""

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        import asyncio

        try:
            while True:
                try:
                    while (msg := await self._call.read()) is not grpc.aio.EOF:  # read(), as wait_started uses it
                        self._resumed()
                        delta = self._collector.feed(msg)
                        if delta is not None:
                            yield delta
                    return
                except grpc.RpcError as error:
                    wait_s = self._next_try_s(error)
                    if wait_s is None:
                        raise
                    await asyncio.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                    self.num_resumes += 1
                    self._call = self._reopen(list(self._collector.token_ids))
        finally:
            self._call.cancel()  # a no-op once the stream has finished

    async def wait_started(self) -> str:
        while not self._collector.request_id:
            self._collector.feed(await self._call.read())
        return self._collector.request_id

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The stream's GenerateResponse messages as they arrive (Started, Deltas, Finished), for a caller that
        encodes them itself (the HTTP gateway): the deltas and .result are then left to it, and so is resuming."""
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                yield msg
        finally:
            self._call.cancel()


def _reopen_request(request: pb.GenerateRequest, received: list[int]) -> pb.GenerateRequest:
    """The request sent again: a new id (the old one may still be known to the server), the tokens received."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.ClearField("request_id")
    del again.resume_token_ids[:]
    again.resume_token_ids.extend(received)
    return again


def _reopener(stub, request: pb.GenerateRequest, timeout: float | None, metadata=None):
    return lambda received: stub.Generate(_reopen_request(request, received), timeout=timeout, metadata=metadata)
