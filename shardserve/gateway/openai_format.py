"""gRPC Generate messages -> OpenAI response bodies and server-sent events (the gateway's output side).

A stream's chunks differ only in a few fields, so each choice encodes its constant JSON prefix once and a chunk
costs one json.dumps of the new text (plus logprobs when asked for): no per-token dicts or pydantic models.
"""

from __future__ import annotations

import json
import time

from shardserve.proto import generation_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict) -> bytes:
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def prompt_tokens(choices: list["Choice"]) -> int:
    """The usage's prompt tokens: each prompt once, however many choices it has (as OpenAI counts them)."""
    return sum(c.prompt_tokens for c in choices if not c.prompt_shared)


def usage_of(choices: list["Choice"]) -> dict:
    """OpenAI's usage object: each prompt counted once, and of its tokens those the prefix cache served."""
    prompt = prompt_tokens(choices)
    completion = sum(c.completion_tokens for c in choices)
    cached = sum(c.cached_tokens for c in choices if not c.prompt_shared)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Choice:
    """One choice of a completion or chat completion: accumulates it (non-streaming) or encodes its chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, index: int, created: int | None = None,
                 top_logprobs: int | None = None, usage_field: bool = False, token_ids: bool = False,
                 echo: bool = False, echo_only: bool = False, prompt_logprobs: bool = False,
                 stop_token_ids=()) -> None:
        self.chat = chat
        self.index = index
        self.logprobs = top_logprobs is not None
        self.with_ids = token_ids  # vLLM's return_token_ids: how a model without a tokenizer shows its output
        self.ids: list[int] = []  # non-streaming, with_ids only
        self.text: list[str] = []
        self.lp_entries: list = []  # pb.TokenLogprob, non-streaming only
        self.offset = 0  # completions' text_offset of the next token
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt's tokens, those the server's prefix cache held
        self.prompt_shared = False  # another choice of the same prompt counts its tokens in the usage (n > 1)
        self.echo = echo  # completions: the prompt (and its logprobs) before the output
        self.echo_only = echo_only  # ... and nothing after it (max_tokens 0: the one token made is left out)
        self.echo_pending = echo  # streaming: the first chunk carries the prompt
        self.prompt_text = ""
        self.first_token_text = ""  # the prompt's first token, which has no logprob
        self.prompt_lp_entries: list = []  # pb.TokenLogprob of the prompt's second token on
        self.started = False
        self.with_prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field of the choice (non-streaming)
        self.stop_token_ids = set(stop_token_ids)  # a stop_reason that is one of them is a token id (an int)
        self.stop_reason: str | int | None = None
        created = int(time.time()) if created is None else created
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": kind, "created": created, "model": model}
        self._prefix = (b"data: " + _dumps(head)[:-1].encode() + b',"choices":[{"index":' + str(index).encode())
        self._suffix = b"}]" + (b',"usage":null' if usage_field else b"") + b"}\n\n"

    # ---- from the gRPC stream -----------------------------------------------------------------------------
    def started_msg(self, msg: pb.GenerateResponse.Started) -> None:
        self.prompt_tokens = msg.prompt_token_count
        self.prompt_text, self.first_token_text = msg.prompt_text, msg.prompt_first_token_text
        if self.echo:  # the output's text_offset counts from the start of the echoed prompt
            self.offset = len(self.prompt_text)

    def finished_msg(self, msg: pb.GenerateResponse.Finished) -> None:
        self.finish_reason = FINISH.get(msg.finish_reason, "stop")
        self.prompt_tokens = msg.usage.prompt_tokens
        self.completion_tokens = 0 if self.echo_only else msg.usage.completion_tokens
        self.cached_tokens = msg.usage.cached_prompt_tokens
        reason = msg.stop_reason or None  # vLLM's stop_reason: the stop string, or the stop token's id as a number
        if reason is not None and reason.isdigit() and int(reason) in self.stop_token_ids:
            reason = int(reason)
        self.stop_reason = reason

    def add(self, delta: pb.GenerateResponse.Delta) -> None:
        """Non-streaming: keeps the delta for body()."""
        if (self.echo or self.with_prompt_logprobs) and delta.prompt_logprobs:
            self.prompt_lp_entries.extend(delta.prompt_logprobs)
        if self.echo_only:
            return
        self.text.append(delta.text)
        if self.with_ids:
            self.ids.extend(delta.token_ids)
        if self.logprobs:
            self.lp_entries.extend(delta.logprobs)

    # ---- streaming ----------------------------------------------------------------------------------------
    def first_chunk(self) -> bytes | None:
        """Chat streams open with the assistant's role (as OpenAI's do)."""
        if not self.chat:
            return None
        return self._chunk(b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null')

    def delta_chunk(self, delta: pb.GenerateResponse.Delta) -> bytes | None:
        """The SSE event of one delta; None when it carries nothing to show (an incomplete character)."""
        if self.echo_pending:
            return self._echo_chunk(delta)
        if self.echo_only:
            return None
        if not delta.text and not (self.logprobs and delta.logprobs) and not (self.with_ids and delta.token_ids):
            return None
        text = _dumps(delta.text).encode()
        lps = _dumps(self._logprobs(delta.logprobs)).encode() if self.logprobs else b"null"
        ids = b',"token_ids":' + _dumps(list(delta.token_ids)).encode() if self.with_ids else b""
        if self.chat:
            return self._chunk(b',"delta":{"content":' + text + b'},"logprobs":' + lps + ids + b',"finish_reason":null')
        return self._chunk(b',"text":' + text + b',"logprobs":' + lps + ids + b',"finish_reason":null')

    def _echo_chunk(self, delta: pb.GenerateResponse.Delta) -> bytes:
        """A completion's first chunk under echo: the prompt, then the delta (unless echo_only)."""
        self.echo_pending = False
        own = not self.echo_only
        text = _dumps(self.prompt_text + (delta.text if own else "")).encode()
        lps = b"null"
        if self.logprobs:
            output = self._logprobs(delta.logprobs if own else [])
            lps = _dumps(self._with_prompt(output, delta.prompt_logprobs)).encode()
        ids = b',"token_ids":' + _dumps(list(delta.token_ids) if own else []).encode() if self.with_ids else b""
        return self._chunk(b',"text":' + text + b',"logprobs":' + lps + ids + b',"finish_reason":null')

    def last_chunk(self) -> bytes:
        reason = _dumps(self.finish_reason).encode()
        body = b',"delta":{}' if self.chat else b',"text":""'
        return self._chunk(body + b',"logprobs":null,"finish_reason":' + reason + b',"stop_reason":'
                           + _dumps(self.stop_reason).encode())

    def _chunk(self, body: bytes) -> bytes:
        return self._prefix + body + self._suffix

    # ---- non-streaming ------------------------------------------------------------------------------------
    def body(self) -> dict:
        text = (self.prompt_text if self.echo else "") + "".join(self.text)
        logprobs = None
        if self.logprobs:
            completion = self._logprobs(self.lp_entries)
            logprobs = self._with_prompt(completion, self.prompt_lp_entries) if self.echo else completion
        if self.chat:
            body = {"index": self.index, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": logprobs, "finish_reason": self.finish_reason}
        else:
            body = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        body["stop_reason"] = self.stop_reason
        if self.with_ids:
            body["token_ids"] = self.ids
        if self.with_prompt_logprobs:  # vLLM's shape: None for the first token, then {token id: its logprob entry}
            body["prompt_logprobs"] = [None] + [_prompt_position(e) for e in self.prompt_lp_entries]
        return body

    # ---- logprobs -----------------------------------------------------------------------------------------
    def _with_prompt(self, completion: dict, prompt_entries) -> dict:
        """Completions' logprobs with the prompt's tokens first: its first token (no logprob: None) and the rest
        (entries for the second on), their offsets from 0; the completion's then start after the prompt's text."""
        tokens = [self.first_token_text] + [e.text for e in prompt_entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens + completion["tokens"],
                "token_logprobs": [None] + [e.logprob for e in prompt_entries] + completion["token_logprobs"],
                "top_logprobs": [None] + [{t.text: t.logprob for t in e.top_logprobs} for e in prompt_entries]
                                + completion["top_logprobs"],
                "text_offset": offsets + completion["text_offset"]}

    def _logprobs(self, entries) -> dict:
        if self.chat:
            return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
                                 "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                                  for t in e.top_logprobs]} for e in entries],
                    "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.text)
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text: t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}


def _prompt_position(entry) -> dict:
    """One prompt position as vLLM's prompt_logprobs have it: the token and its top alternatives, keyed by id."""
    out = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.text}}
    for rank, top in enumerate(entry.top_logprobs, start=1):
        out.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.text})
    return out


def response_body(chat: bool, request_id: str, model: str, choices: list[Choice], replica: str = "") -> dict:
    body = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [c.body() for c in choices], "usage": usage_of(choices)}
    if replica:
        body["system_fingerprint"] = replica
    return body


def usage_chunk(chat: bool, request_id: str, model: str, choices: list[Choice]) -> bytes:
    """stream_options.include_usage: the last chunk before [DONE], with no choices."""
    return sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [], "usage": usage_of(choices)})
