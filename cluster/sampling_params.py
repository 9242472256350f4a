"""SamplingParams: how a request is sampled and when it stops. Each field's range is checked here, when the params
are made (at the edge, never in the step loop); what depends on the model (stop token ids within the vocabulary)
is checked with the prompt at admission (cluster/admission.py)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from shardserve.cluster.errors import excerpt
from shardserve.cluster.structured_outputs import StructuredOutputsParams, as_structured_outputs
from shardserve.proto.plan import SamplingSpec

MAX_LOGPROBS = 20
MAX_N = 16  # outputs per prompt (SamplingParams.n)
MAX_LOGIT_BIAS = 1024  # entries in SamplingParams.logit_bias
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's API takes it


def output_seed(seed: int | None, i: int) -> int | None:
    """The seed output i of a prompt's n draws with (LLM.generate, the HTTP gateway): seed + i, so that each is what
    a request of its own with that seed gives; None stays None (the engine draws a seed per request)."""
    return seed + i if seed is not None else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first(items, wrong) -> int | None:
    """The index of the first item `wrong` says is wrong, or None."""
    return next((i for i, item in enumerate(items) if wrong(item)), None)


def _param(default, help: str, cli: bool = True):
    """cli=False: an API and wire field only, with no command-line flag (shardserve/cli/flags.py)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass
class SamplingParams:
    """Every field is also a GenerateRequest field (generation.proto) and a command-line flag (shardserve/cli/flags.py),
    mapped by name; the fields a worker needs go on to SamplingSpec (proto/plan.py) by name too (to_spec)."""

    temperature: float = _param(1.0, "0 = greedy")
    top_k: int = _param(0, "sample from the k most likely tokens; 0 or -1 = off")
    top_p: float = _param(1.0, "sample from the smallest set of tokens whose probability reaches p, in (0, 1]")
    min_p: float = _param(0.0, "drop tokens below min_p times the top token's probability, in [0, 1]")
    repetition_penalty: float = _param(1.0, "> 0, 1 = off: divides the logits of prompt and generated tokens")
    presence_penalty: float = _param(0.0, "in [-2, 2]: subtracted once from the logit of each generated token")
    frequency_penalty: float = _param(0.0, "in [-2, 2]: subtracted per occurrence of each generated token")
    seed: int | None = _param(None, "same seed -> same tokens, whatever the batch, preemption or TP size")
    max_tokens: int | None = _param(16, "tokens to generate at most; None (unset over gRPC): the rest of the context")
    min_tokens: int = _param(0, "tokens generated before a stop token or eos may end the request")
    stop: list[str] | str | None = _param(None, "a stop string (repeatable), never part of the output text")
    stop_token_ids: list[int] | None = _param(None, "a token id that ends the request (repeatable)")
    ignore_eos: bool = _param(False, "keep generating past the end-of-sequence token")
    logprobs: int | None = _param(None, f"N in [0, {MAX_LOGPROBS}]: the sampled token's logprob plus the top N")
    prompt_logprobs: int | None = _param(
        None, f"N in [0, {MAX_LOGPROBS}]: each prompt token's logprob plus the top N (the first token's is None)")
    skip_special_tokens: bool = _param(True, "leave special tokens (eos, chat markers) out of the output text")
    include_stop_str_in_output: bool = _param(False, "keep the stop string that ended the request in the text")
    final_only: bool = _param(False, "no per-token stream: the whole answer comes in one message when the request "
                                     "ends (offline and batch work: spares the server a message per token)")
    n: int = _param(1, f"outputs per prompt, 1-{MAX_N}: LLM.generate makes them as n requests (output i draws with "
                       "seed + i); a request to the engine (gRPC) makes one", cli=False)
    best_of: int | None = _param(None, "candidates per prompt: not supported (None or 1)", cli=False)
    logit_bias: dict[int, float] | None = _param(
        None, f"token id -> a number in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] added to its logit before "
              f"penalties and sampling (-100 all but bans it, +100 all but forces it); at most {MAX_LOGIT_BIAS} "
              "entries; the flag: TOKEN_ID=BIAS, repeatable")
    structured_outputs: StructuredOutputsParams | None = _param(
        None, "the output must match one of: a JSON schema (json), any JSON object (json_object), a regex, a choice "
              "among strings, an EBNF grammar (a StructuredOutputsParams, or a dict of its fields)", cli=False)

    def __post_init__(self) -> None:
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
        self._check()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    def _check(self) -> None:
        def bad(name: str, allowed: str, at: int | None = None) -> ValueError:
            """The field, its range and a bounded excerpt of what came (of a list: the entry at fault, `at`)."""
            value = getattr(self, name)
            if at is None:
                return ValueError(f"{name} must be {allowed}, got {excerpt(value)}")
            return ValueError(f"{name} must be {allowed}, got {excerpt(value[at])} at index {at} of {len(value)}")

        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "a number in [0, 100] (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2**63) or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1, or None for the rest of the context")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise bad("min_tokens", "an integer in [0, max_tokens]")
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, (list, tuple)):
                raise bad("stop", "a non-empty string or a list of them")
            if (i := _first(self.stop, lambda s: not (isinstance(s, str) and s))) is not None:
                raise bad("stop", "a non-empty string or a list of them", at=i)
        elif isinstance(self.stop, str) and not self.stop:
            raise bad("stop", "a non-empty string or a list of them")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise bad("stop_token_ids", "a list of token ids >= 0")
            if (i := _first(self.stop_token_ids, lambda t: not (_is_int(t) and t >= 0))) is not None:
                raise bad("stop_token_ids", "a list of token ids >= 0", at=i)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "True or False")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "final_only"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"a dict of at most {MAX_LOGIT_BIAS} token ids -> biases")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids -> biases, got "
                                 f"{len(self.logit_bias)} entries")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias must be keyed by token ids >= 0, got the key {excerpt(token)}")
                if not _is_number(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                    raise ValueError(f"logit_bias must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                     f"got {excerpt(bias)} for token {token}")
        if self.structured_outputs is not None:
            if self.ignore_eos and not self.stop_token_ids:
                raise ValueError("structured_outputs ends the output with a stop token once the grammar is complete: "
                                 "ignore_eos needs stop_token_ids to end it")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs (the grammar decides where "
                                 "the output ends)")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={excerpt(self.best_of)}: best-of-n candidates are not supported; ask for n "
                             "outputs and pick among them")

    def to_spec(self, eos_token_ids: list[int], default_seed: int) -> SamplingSpec:
        """The worker's view: the fields both have, by name, and what the worker needs in its own form. A request
        without a seed gets `default_seed` (the engine draws it from its own seeded generator), so every rank
        samples identically and one engine seed makes a whole run reproducible."""
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        kind, text = self.structured_outputs.kind_and_text() if self.structured_outputs is not None else ("", "")
        return SamplingSpec(
            **{name: convert(getattr(self, name)) for name, convert in _SHARED_WITH_SPEC.items()},
            grammar_kind=kind,
            grammar=text,
            seed=self.seed if self.seed is not None else default_seed,
            logprobs=-1 if self.logprobs is None else self.logprobs,
            prompt_logprobs=-1 if self.prompt_logprobs is None else self.prompt_logprobs,
            stop_token_ids=stop_ids,
            logit_bias={token: float(bias) for token, bias in (self.logit_bias or {}).items()},
        )


# SamplingSpec fields that take SamplingParams' value as it is, by name -> the spec's type (float or int).
_SHARED_WITH_SPEC = {
    name: kind for name, kind in typing.get_type_hints(SamplingSpec).items()
    if name not in ("seed", "logprobs", "prompt_logprobs", "stop_token_ids", "logit_bias", "grammar_kind", "grammar")
}
