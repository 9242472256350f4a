"""The client's streams: a Generate call's messages folded into deltas and a GenerationResult, and resuming a stream
that broke with UNAVAILABLE, or a CANCELLED the client did not ask for (shardserve/client/resume.py makes the request
sent again; shardserve/client/clients.py's module docstring says when and why that is exact)."""

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
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the server's prefix cache held


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
    prompt_text: str | None = None  # with echo=True: the prompt as text (token ids decoded by the server)


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
        self.seed: int | None = None  # the seed the server told (its own draw for an unseeded request)
        self.prompt_text: str | None = None  # echo: the server's Started.prompt_text
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.had_prompt_logprobs = False  # they came (a resumed call does not ask for them again)
        self.result: GenerationResult | None = None

    def track(self, msg: pb.GenerateResponse) -> None:
        """Only what resuming needs (the id, the seed, the tokens): for a caller that folds the messages itself."""
        kind = msg.WhichOneof("kind")
        if kind == "delta":
            self.token_ids += msg.delta.token_ids
            self.had_prompt_logprobs = self.had_prompt_logprobs or bool(msg.delta.prompt_logprobs)
        elif kind == "started":
            self.request_id = msg.started.request_id
            if msg.started.HasField("seed"):
                self.seed = msg.started.seed

    def feed(self, msg: pb.GenerateResponse) -> StreamDelta | None:
        kind = msg.WhichOneof("kind")
        if kind == "started":
            self.request_id, self.prompt_tokens = msg.started.request_id, msg.started.prompt_token_count
            if msg.started.HasField("seed"):
                self.seed = msg.started.seed
            if msg.started.prompt_text:
                self.prompt_text = msg.started.prompt_text
        elif kind == "delta":
            lps = _logprobs(msg.delta.logprobs) if msg.delta.logprobs else None
            if lps is not None:
                self.logprobs = (self.logprobs or []) + lps
            prompt_lps = None
            if msg.delta.prompt_logprobs:
                prompt_lps = self.prompt_logprobs = [None, *_logprobs(msg.delta.prompt_logprobs)]
                self.had_prompt_logprobs = True
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
                usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_prompt_tokens),
                logprobs=self.logprobs,
                replica=f.replica,
                stop_reason=f.stop_reason or None,
                prompt_logprobs=self.prompt_logprobs,
                prompt_text=self.prompt_text,
            )
        return None


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
        self._cancelled_here = False  # cancel() was called: a CANCELLED that follows is the caller's own
        self.num_resumes = 0  # how many times the stream was sent again

    def _next_try_s(self, error: grpc.RpcError) -> float | None:
        """After a broken call: seconds to wait before sending the request again, or None to raise the error."""
        import time

        if self._reopen is None or not self._is_break(error) or self._collector.result is not None:
            return None
        if not self._collector.request_id:  # refused before it was admitted (starting, draining): not a break
            return None
        if not self._reopen.can_resume(self._collector.seed):  # sampled, and the server told no seed
            return None
        now = time.monotonic()
        if self._resume_until is None:
            self._resume_until = now + self._resume_timeout_s
        if now >= self._resume_until:
            return None
        wait_s, self._resume_wait_s = self._resume_wait_s, min(2 * self._resume_wait_s, RESUME_BACKOFF_S[1])
        return min(wait_s, self._resume_until - now)

    def _is_break(self, error: grpc.RpcError) -> bool:
        """UNAVAILABLE (the server lost the request, or went away), or a CANCELLED this client did not ask for: the
        server's side cancelled the call (gRPC cancels calls still open when a stopping server's grace ends)."""
        code = error.code()
        return code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.CANCELLED and not self._cancelled_here)


    def _resume(self) -> None:
        """Sends the request again with what the stream has: its tokens, its seed; not its prompt logprobs again."""
        self.num_resumes += 1
        c = self._collector
        self._call = self._reopen(list(c.token_ids), c.seed, c.had_prompt_logprobs)

    def _resumed(self, msg: pb.GenerateResponse) -> None:
        """A message came: once a delta came on a resumed call, the resume worked and the next break starts a new
        budget (a Started alone is no progress: a server that keeps breaking before a token is not retried forever)."""
        if self._resume_until is not None and msg.WhichOneof("kind") == "delta":
            self._resume_until, self._resume_wait_s = None, RESUME_BACKOFF_S[0]

    def _take(self, msg: pb.GenerateResponse) -> StreamDelta | None:
        """A message came: noted (_resumed), then folded into the delta it makes (None for a Started alone)."""
        self._resumed(msg)
        return self._collector.feed(msg)

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    @property
    def seed(self) -> int | None:
        """The request's seed as the server told it (for an unseeded request: the one it drew), once started."""
        return self._collector.seed

    @property
    def result(self) -> GenerationResult | None:
        return self._collector.result

    def cancel(self) -> None:
        """Ends the stream; the server aborts the request and frees its cache blocks."""
        self._cancelled_here = True
        self._call.cancel()


class Stream(_StreamState):
    """Iterates a request's deltas. request_id is known after the first delta (or call .wait_started());
    .result is set once the stream has finished."""

    def __iter__(self) -> Iterator[StreamDelta]:
        import time

        while True:
            try:
                for msg in self._call:
                    if (delta := self._take(msg)) is not None:
                        yield delta
                return
            except grpc.RpcError as error:
                if (wait_s := self._next_try_s(error)) is None:
                    raise  # (here: a helper raising it would keep the error in its frame, a cycle)
                time.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                self._resume()

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
                        if (delta := self._take(msg)) is not None:
                            yield delta
                    return
                except grpc.RpcError as error:
                    if (wait_s := self._next_try_s(error)) is None:
                        raise  # (here: a helper raising it would keep the error in its frame, a cycle)
                    await asyncio.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                    self._resume()
        finally:
            self._call.cancel()  # a no-op once the stream has finished

    async def wait_started(self) -> str:
        while not self._collector.request_id:
            self._collector.feed(await self._call.read())
        return self._collector.request_id

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The stream's GenerateResponse messages as they arrive (Started, Deltas, Finished), for a caller that
        encodes them itself (the HTTP gateway): the deltas and .result are then left to it. A broken stream resumes
        as __aiter__'s does; the resumed call's own Started is not passed on (the caller has the first)."""
        import asyncio

        try:
            while True:
                try:
                    while (msg := await self._call.read()) is not grpc.aio.EOF:
                        self._resumed(msg)
                        if self.num_resumes and msg.WhichOneof("kind") == "started":
                            continue
                        self._collector.track(msg)
                        yield msg
                    return
                except grpc.RpcError as error:
                    if (wait_s := self._next_try_s(error)) is None:
                        raise  # (here: a helper raising it would keep the error in its frame, a cycle)
                    await asyncio.sleep(wait_s)  # backoff: the server is restarting its group, or itself
                    self._resume()
        finally:
            self._call.cancel()
