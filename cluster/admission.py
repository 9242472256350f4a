"""Admission: a request as a front end gives it -> a Request the engine can run, or a ValueError saying why not.

Every front end admits through Engine.admit (LLM with one engine or several, the server's replicas, and so the gRPC
Generation service and a gateway over it), and Engine.admit through these functions, the source of truth for what
a request may be:
- `encode_prompt`: a prompt given as text, token ids or chat messages -> an EncodedPrompt (the one place prompts are
  encoded; Engine.admit runs it, unless a front end encoded the prompt already because it routes by token ids or
  tokenizes off the engine's thread: the server's pool, cluster/prompt_encoder.py);
- `check_request`: the prompt's token ids and the SamplingParams against the engine's limits (vocabulary,
  max_model_len, KV blocks), once per admission. SamplingParams checks its own fields' ranges when it is made;
- `check_resumed`: the tokens a resuming client already has;
- `Seeds`: each unseeded request's seed, in admission order from the engine's seed. A front over several engines
  (the controller, LLM with data_parallel_size > 1) draws it before routing, so a request's draws do not depend on
  the engine it lands on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from shardserve.cluster.errors import excerpt
from shardserve.cluster.detokenizer import IncrementalDetokenizer
from shardserve.cluster.request import Request
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto.plan import SamplingSpec, cdiv

CHAT_ROLES = ("system", "user", "assistant", "tool")
# text, token ids, chat messages ({"role", "content"}, an assistant's "tool_calls", a tool's "tool_call_id"), chat
# with tools ({"messages": [...], "tools": [...]}: the chat template renders the tools), or vLLM's prompt dicts
# ({"prompt": text} or {"prompt_token_ids": [...]})
Prompt = str | list[int] | list[dict] | dict
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


class EncodedPrompt(NamedTuple):
    """A prompt as token ids, and its text (None when it came as token ids)."""

    text: str | None
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Admitted:
    """What an engine took: the prompt's length, and the max_tokens and seed the request runs with (filled in where
    the caller left them unset)."""

    num_prompt_tokens: int
    max_tokens: int
    seed: int

    @property
    def cost(self) -> int:
        """The tokens the request may hold at most: what a router counts as its load."""
        return self.num_prompt_tokens + self.max_tokens


class Seeds:
    """Each unseeded request's seed, drawn in admission order from one generator seeded by the engine's seed, so
    every rank samples identically and one engine seed makes a whole run reproducible."""

    def __init__(self, seed: int | None) -> None:
        self._draws = random.Random(seed)

    def fill(self, params: SamplingParams) -> SamplingParams:
        return params if params.seed is not None else replace(params, seed=self._draws.getrandbits(63))


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(prompt: Prompt | EncodedPrompt, tokenizer) -> EncodedPrompt:
    """(the prompt's text, or None when it came as token ids; its token ids). Token ids are passed on unchecked
    (check_request checks them), and so is a prompt encoded already; raises ValueError for text or chat a model
    cannot take."""
    if isinstance(prompt, EncodedPrompt):
        return prompt
    tools = None
    if isinstance(prompt, dict) and "messages" in prompt:
        prompt, tools = _unwrap_chat_with_tools(prompt)
    elif isinstance(prompt, dict):
        prompt = _unwrap_prompt_dict(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): send token ids")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return EncodedPrompt(prompt, tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if not has_chat_template(tokenizer):
            raise ValueError("this model has no chat template: send text or token ids")
        for m in prompt:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"chat roles must be one of {', '.join(CHAT_ROLES)}; got {excerpt(m.get('role'))}")
            if not isinstance(m.get("content"), str):
                raise ValueError("every chat message needs a string content")
        with_tools = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template([_template_message(m) for m in prompt], add_generation_prompt=True,
                                             tokenize=False, **with_tools)
        return EncodedPrompt(text, tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, (list, tuple)):
        return EncodedPrompt(None, list(prompt))
    raise ValueError(f"a prompt is text, token ids or chat messages; got {type(prompt).__name__}")


def _unwrap_chat_with_tools(prompt: dict) -> tuple[list, list | None]:
    unknown = sorted(set(prompt) - {"messages", "tools"})
    if unknown:
        raise ValueError(f"a chat prompt dict takes 'messages' and 'tools'; got {', '.join(map(repr, unknown))}")
    messages, tools = prompt["messages"], prompt.get("tools")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of tool definitions")
    return list(messages), tools or None


def _template_message(m: dict) -> dict:
    """A chat message as chat templates read it: an assistant's tool calls with their arguments as objects (OpenAI
    sends them as JSON text; the templates render them with tojson)."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for call in m["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # left as the text it is
        calls.append({**call, "function": function})
    return {**m, "tool_calls": calls}


def prompt_text_bytes(prompt: Prompt) -> int:
    """How many bytes of text (UTF-8) a prompt holds: its text, or its chat messages' contents; 0 for token ids.
    Cheap next to tokenizing, so limits can be checked before it."""
    if isinstance(prompt, dict) and "messages" in prompt:
        prompt = prompt["messages"] if isinstance(prompt["messages"], list) else []
    elif isinstance(prompt, dict):
        prompt = prompt.get("prompt", "")
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    if isinstance(prompt, (list, tuple)):
        return sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in prompt
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def _unwrap_prompt_dict(prompt: dict) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [...]}; anything else is refused by name."""
    unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if unknown:
        raise ValueError(
            f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (a list of token ids); "
            f"got unsupported key(s) {', '.join(map(repr, unknown))}"
        )
    if len(prompt) != 1:
        raise ValueError("a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' must be text, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
    return list(ids)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What an engine can take: its model's vocabulary, its max_model_len and its KV cache."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int


def check_request(token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """Raises ValueError for a request that is malformed or could never run (so none is left waiting forever).
    Returns the params to run it with: max_tokens None becomes the rest of the context (as vLLM's OpenAI server
    does), the tokens max_model_len and the KV cache leave after the prompt (a copy: params may be shared)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:  # LLM.generate and the HTTP gateway send n requests instead
        raise ValueError(f"n={params.n}: a request makes one output; send the prompt n times (the i-th with seed + i, "
                         "as LLM.generate and the HTTP gateway do)")
    if not token_ids:
        raise ValueError("prompt must not be empty")
    vocab = limits.vocab_size
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {excerpt(t)}")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
        if (past := next((t for t in ids if t >= vocab), None)) is not None:  # (SamplingParams checked >= 0)
            raise ValueError(f"{name} must be token ids below the vocabulary size {vocab}, got {past}")
    num_prompt, max_tokens = len(token_ids), params.max_tokens
    if max_tokens is None:
        room = min(limits.max_model_len, limits.num_kv_blocks * limits.block_size + 1) - num_prompt
        if room < max(1, params.min_tokens):
            raise ValueError(f"prompt ({num_prompt} tokens) leaves no room to generate within max_model_len "
                             f"({limits.max_model_len}) and the KV cache ({limits.num_kv_blocks} blocks of "
                             f"{limits.block_size} tokens)")
        params = replace(params, max_tokens=room)
        max_tokens = room
    total = num_prompt + max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({limits.max_model_len})"
        )
    # The last sampled token is never fed back, so its KV is never stored.
    needed = cdiv(total - 1, limits.block_size)
    if needed > limits.num_kv_blocks:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks of "
            f"{limits.block_size} tokens, but the cache has only {limits.num_kv_blocks}"
        )
    return params


def check_request_id(req_id: str, in_use) -> None:
    """A request id is a non-empty string that in_use(req_id) says is free."""
    if not isinstance(req_id, str) or not req_id:
        raise ValueError(f"request id must be a non-empty string, got {req_id!r}")
    if in_use(req_id):
        raise ValueError(f"request id {req_id!r} is already in use")


def check_resumed(resumed: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """The tokens a resuming client already has: token ids of the vocabulary, fewer than max_tokens (filled in)."""
    bad = [t for t in resumed if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"resumed token ids must be integers in [0, {vocab_size}), got {bad[0]!r}")
    if len(resumed) >= params.max_tokens:
        raise ValueError(f"{len(resumed)} resumed tokens leave nothing of max_tokens ({params.max_tokens})")


def new_request(req_id: str, prompt: EncodedPrompt, params: SamplingParams, spec: SamplingSpec, arrival: int,
                tokenizer, resumed: Sequence[int]) -> Request:
    """The admitted request's state, with its detokenizer where there is a tokenizer; resumed tokens count as
    generated and are not streamed again (their text neither)."""
    seq = Request(req_id, prompt.token_ids, params, spec, arrival=arrival, prompt=prompt.text)
    if tokenizer is not None:
        seq.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt.token_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
    for token in resumed:
        seq.append_token(token)
        if seq.detokenizer is not None:
            seq.detokenizer.add_token(token, check_stop=False)
    if resumed and seq.detokenizer is not None:
        seq.detokenizer.take_delta(False)  # the caller has that text already
    seq.num_emitted_tokens = len(resumed)
    return seq
