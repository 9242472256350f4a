"""The OpenAI request bodies the HTTP gateway accepts (shardserve/gateway/app.py), as pydantic models.

Three kinds of fields:
- mapped onto the gRPC GenerateRequest (temperature, top_p, seed, stop, max_tokens, logprobs, logit_bias, ...;
  `n`: as many requests a prompt, the i-th with seed + i), plus vLLM's
  extensions the engine has (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
  skip_special_tokens, include_stop_str_in_output, prompt_logprobs; priority 0, the only one a first-come
  scheduler has) and its `return_token_ids` (the output's token ids next to its text: a model without a tokenizer
  has no text);
- OpenAI fields that change nothing here and are accepted and ignored (`user`, `metadata`, `store`, ...);
- structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*` fields
  (shardserve/gateway/structured_fields.py), sent as the GenerateRequest's structured_outputs;
- OpenAI fields that would change the answer in a way we cannot honour (`best_of`, `suffix`, `audio`, ...):
  `unsupported()` names them, and the gateway answers 400 with that field as `param`.
Any other field is refused by pydantic (extra="forbid"), as OpenAI refuses unrecognized arguments, and so is a value
of another JSON type (strict: "8" is no integer, 8.0 no integer either, as OpenAI's API has it).
Ranges are the server's to check (its INVALID_ARGUMENT reason comes back in the 400); only shapes are checked here,
and the ranges of the fields whose names differ from the server's (chat's top_logprobs, max_completion_tokens), so
that a 400 names the field the request used.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardserve.cluster.errors import excerpt
from shardserve.cluster.sampling_params import MAX_LOGPROBS, MAX_N  # as LLM.generate's
from shardserve.gateway.structured_fields import structured_outputs_of
from shardserve.gateway.tool_calls import ToolMode, tool_mode, tool_schema
from shardserve.gateway.unsupported import UnsupportedField


STRICT = ConfigDict(extra="forbid", strict=True)  # no unknown fields, no values of another JSON type


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool | None = None  # an OpenAI anti-side-channel padding field: ignored


class _Request(BaseModel):
    """What completions and chat completions share."""

    model_config = STRICT

    model: str | None = None  # absent: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None  # choices a prompt (each sampled as a request of its own; seed + i for the i-th)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, which the engine has (the openai SDK sends them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # each choice (and chunk) also carries its token ids: for token-id-only models
    skip_special_tokens: bool | None = None  # absent: true (eos, chat markers left out of the text)
    include_stop_str_in_output: bool | None = None  # the matched stop string stays in the text
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top N, as vLLM's choices carry them
    priority: int = 0  # vLLM's priority scheduling: this server schedules first come, first served (0 only)
    # structured outputs, vLLM's spellings (the current one and the older guided_*): structured_fields.py
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: one backend here (xgrammar)
    guided_whitespace_pattern: str | None = None  # accepted and ignored
    # accepted and ignored: they change nothing about the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def echo_only(self) -> bool:
        """The prompt alone, no output: completions' echo with max_tokens 0 (chat has no echo)."""
        return False

    def unsupported(self) -> UnsupportedField | None:
        if self.priority != 0:
            return UnsupportedField("priority", f"priority {self.priority}: this server schedules first come, first "
                                    "served (priority scheduling is not supported; leave it 0)")
        if self.prompt_logprobs is not None and self.stream:
            return UnsupportedField("prompt_logprobs", "prompt_logprobs is supported without stream only")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            return UnsupportedField("n", f"n must be an integer in [1, {MAX_N}], got {self.n}")
        for token in self.logit_bias or ():
            if not token.isascii() or not token.isdigit():
                return UnsupportedField("logit_bias", f"logit_bias keys must be token ids (digits), got "
                                                      f"{excerpt(token)}")
        try:
            self.structured()
        except UnsupportedField as e:
            return e
        return None

    def structured(self) -> dict | None:
        """The structured_outputs this request asks for (UnsupportedField for a malformed or doubled one)."""
        return structured_outputs_of(self, getattr(self, "response_format", None))

    def sampling(self) -> dict[str, Any]:
        """The gRPC sampling fields this request sets (unset ones take the server's defaults)."""
        fields = dict(temperature=self.temperature, top_p=self.top_p, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop, top_k=self.top_k,
                      min_p=self.min_p, repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                      ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                      logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias
                      else None, skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      prompt_logprobs=self.prompt_logprobs, structured_outputs=self.structured())
        return {k: v for k, v in fields.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids; a list of several: one choice each
    max_tokens: int | None = None  # absent: OpenAI's default for completions, 16
    logprobs: int | None = None  # the sampled token's logprob plus the top N
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> UnsupportedField | None:
        if self.best_of is not None and self.best_of != 1:
            return UnsupportedField("best_of", f"best_of must be 1, got {self.best_of}")
        if self.suffix:
            return UnsupportedField("suffix", "suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and (not self.prompt or any(p in ("", []) for p in self.prompt)):
            return UnsupportedField("prompt", "prompt must not be empty")
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        fields["max_tokens"] = 16 if self.max_tokens is None else self.max_tokens
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        if self.echo:  # the prompt (and with logprobs its tokens' logprobs) comes before the completion
            fields["echo"] = True
            if self.logprobs is not None and self.prompt_logprobs is None:
                fields["prompt_logprobs"] = self.logprobs
            if self.echo_only:
                fields["max_tokens"] = 1  # one token is made and left out of the answer
        return fields

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as evaluation harnesses ask for it."""
        return self.echo and self.max_tokens == 0


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """image_url, input_audio, file, ...: parsed so that the 400 can name what was sent."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None  # ignored: the chat template has no place for it
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # absent (both): the server's, the rest of the context
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # rendered by the chat template; calls parsed or constrained (tool_calls.py)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None

    def unsupported(self) -> UnsupportedField | None:
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options",
                     "reasoning_effort"):
            if getattr(self, name):
                return UnsupportedField(name, f"{name} is not supported by this server")
        try:
            self.tool_mode()
        except UnsupportedField as e:
            return e
        if self.modalities and self.modalities != ["text"]:
            return UnsupportedField("modalities", "only the text modality is supported")
        if self.top_logprobs is not None and not self.logprobs:
            return UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            return UnsupportedField("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                                    f"{self.top_logprobs}")
        for name in ("max_completion_tokens", "max_tokens"):  # (the server's name for both is max_tokens)
            if (value := getattr(self, name)) is not None and value < 1:
                return UnsupportedField(name, f"{name} must be an integer >= 1, got {value}")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if not isinstance(part, TextPart):
                        return UnsupportedField(f"messages.{i}.content.{j}.type",
                                                f"only text content is supported, got {part.type!r}")
        return super().unsupported()

    def chat(self) -> list[dict] | dict:
        """The messages as the gRPC API takes them ("developer" is OpenAI's newer name for "system"), with the
        tools where the request has them ({"messages": [...], "tools": [...]}: the chat template renders them)."""
        out = []
        for m in self.messages:
            content = m.content or m.refusal or ""
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            message = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return {"messages": out, "tools": self.tools} if self.tools else out

    def tool_mode(self) -> ToolMode | None:
        """What tools and tool_choice ask for (tool_calls.py); UnsupportedField for bad ones."""
        return tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> dict | None:
        spec = super().structured()
        mode = self.tool_mode()
        schema = tool_schema(mode, self.tools, self.parallel_tool_calls) if mode is not None else None
        if schema is None:
            return spec
        if spec is not None:
            raise UnsupportedField("tool_choice", "a required or named tool_choice constrains the output: it "
                                                  "cannot be combined with response_format or guided fields")
        return {"json": schema}

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        if self.limit is not None:
            fields["max_tokens"] = self.limit
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields
