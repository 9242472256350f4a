"""The step plan and the step result: the only things the controller (cluster/) and the workers (worker/) exchange.

Both sides import this file and nothing of each other. In one process these dataclasses travel as they are
(worker/inprocess.py); across processes proto/convert.py maps them one-to-one onto protobuf messages in
worker.proto. Plans carry deltas only:

- A request the workers have not seen yet (or one coming back after preemption) arrives once in `new_requests`,
  with every token known so far, its block table and its sampling settings. The workers keep that state.
- Every later step names it in `req_ids` with how many tokens to compute (`num_tokens`) and, in `new_block_ids`,
  only the blocks appended to its table since the last plan.
- Each scheduled request computes positions [num_computed, num_computed + n) of its token list. When that reaches
  the end of the list (prefill complete, or a decode), the workers sample one token and append it to their own copy
  of the list, so the next decode step needs no token from the controller (this is what lets the controller plan
  step N+1 before step N's result is back).
- Speculative decoding: `draft_token_ids` gives a request the d tokens proposed to follow its token list. The
  workers append them, compute num_tokens = 1 + d positions (the last known token and the drafts: one forward),
  sample at each of the d + 1 positions and keep the drafts up to the first one the sample differs from, plus the
  sample there (worker/spec_verify.py). The result then lists the request once per token it gained (1 to d + 1,
  consecutive entries), and both sides drop the rejected drafts: the request's computed count ends before its
  new last token, and its block table is cut to the blocks its tokens occupy (the same rule on both sides).
- `finished_req_ids` and `preempted_req_ids` tell the workers to drop a request's state. A preempted request comes
  back later in `new_requests` with all its tokens (prompt + generated so far): its KV is recomputed.

Invariants the workers may check (a violation is a bug in the controller, not bad user input):
- step ids increase by exactly one per plan;
- a request id in `req_ids` is either in `new_requests` of this plan or was in one earlier and not dropped since.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingSpec:
    """What a worker needs to pick a request's next token (the validated subset of SamplingParams)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; applies to prompt and generated tokens
    presence_penalty: float = 0.0  # applies to generated tokens
    frequency_penalty: float = 0.0  # applies to generated tokens
    seed: int = 0  # always set: the controller draws one when the user gave none
    logprobs: int = -1  # -1 = none; N >= 0 = the sampled token's logprob plus the top N
    min_tokens: int = 0  # until this many tokens are generated, `stop_token_ids` cannot be sampled
    stop_token_ids: list[int] = field(default_factory=list)  # eos (unless ignore_eos) + the user's stop ids
    prompt_logprobs: int = -1  # -1 = none; N >= 0 = each prompt token's logprob plus the top N (StepResult)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (empty: none)
    # Structured output (proto/grammar.py): "" = none, else one of GRAMMAR_KINDS; `grammar` is its canonical text
    # (a JSON schema, a regex, a JSON list of choices, an EBNF grammar; "" for json_object). The workers compile it
    # (cached by text) and mask every sampling step of the request with it.
    grammar_kind: str = ""
    grammar: str = ""


@dataclass(slots=True)
class NewRequest:
    """A request the workers have not seen, or one resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt + tokens generated before a preemption
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties and seeds need this)
    num_computed_tokens: int  # tokens whose KV is already in the cache (a prefix-cache hit); a multiple of block_size
    block_ids: list[int]  # the whole block table at this step
    sampling: SamplingSpec


@dataclass(slots=True)
class StepPlan:
    step_id: int  # starts at 1, +1 each plan
    new_requests: list[NewRequest] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)  # every request computed this step, in batch order
    num_tokens: list[int] = field(default_factory=list)  # tokens to compute for each entry of req_ids
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # blocks appended since the last plan
    finished_req_ids: list[str] = field(default_factory=list)  # finished or aborted: drop state (before this step)
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted: drop state (before this step)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposed tokens to verify (speculation)
    # Pipeline stages before the last do not sample, so they do not know the tokens their requests sampled: per
    # entry of req_ids, the token its previous step sampled (-1: none). Empty unless pipeline_parallel_size > 1,
    # where a request is never in two plans in flight, so the controller always has that token when it plans.
    sampled_token_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (non-negative ints): e.g. the blocks that hold a tokens at b tokens a block."""
    return -(-a // b)


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled (or prompt) token, from the model's distribution before any sampling transform
    top_ids: list[int]  # the top N token ids, best first
    top_logprobs: list[float]
    rank: int = 0  # of that token in the distribution: 1 + the number of tokens more likely than it


@dataclass(slots=True)
class PromptLogprobs:
    """The logprobs of prompt tokens [start, start + len(logprobs)) of one request, each from the logits of the
    position before it (so `start` >= 1). A chunked prefill reports its chunks' positions step by step; a
    recomputed (preempted) request may report positions again."""

    req_id: str
    start: int
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class StepResult:
    step_id: int
    # requests that sampled a token this step, in batch order; a request that verified drafts appears once per
    # token it gained (consecutive entries, in token order)
    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the sampled token of each
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # one per entry, None where not asked
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # prompt positions this step computed
    grammar_mask_ms: float = 0.0  # host time of this step's structured-output masks (worker/grammar_matchers.py)
    forward_ms: float = 0.0  # the worker's own time for this step (inputs, forward, sampling): device time on CUDA
    #   (CUDA events around the step's kernels), host time elsewhere
