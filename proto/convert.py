"""Conversions between the dataclasses of proto/plan.py and proto/config.py and their worker.proto messages, and
`message_fields`: a message's fields as a same-named dataclass's keywords (also GenerateRequest -> SamplingParams,
cluster/generation_service.py).

Both sides of the Step stream call these every step (the controller encodes plans and decodes results, the
workers decode plans and encode results), so they stay flat: repeated scalar fields are filled and read in
one call each (protobuf does that loop in C), and messages are built with keyword arguments, not field by field.
Round trips are exact: floats travel as doubles, and the conversions carry every field.
"""

from __future__ import annotations

from dataclasses import fields

from shardserve.proto import worker_pb2 as pb
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import NewRequest, PromptLogprobs, SamplingSpec, StepPlan, StepResult, TokenLogprobs


def message_fields(msg, names) -> dict:
    """The fields `names` of a message as keyword arguments for a same-named dataclass: repeated fields as lists,
    maps as dicts; an `optional` field left unset (or an empty map) is left out, so that the dataclass default
    (e.g. None) applies."""
    fields_by_name = msg.DESCRIPTOR.fields_by_name
    kwargs = {}
    for name in names:
        fd = fields_by_name[name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if getattr(msg, name):  # an empty map is an unset one (proto3 cannot tell them apart)
                kwargs[name] = dict(getattr(msg, name))
        elif fd.is_repeated:
            kwargs[name] = list(getattr(msg, name))
        elif not fd.has_presence or msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return kwargs


_SPEC_FIELDS = tuple(f.name for f in fields(SamplingSpec))  # worker.proto's SamplingSpec has each (a test checks)


def sampling_spec_to_proto(spec: SamplingSpec) -> pb.SamplingSpec:
    return pb.SamplingSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def sampling_spec_from_proto(msg: pb.SamplingSpec) -> SamplingSpec:
    return SamplingSpec(**message_fields(msg, _SPEC_FIELDS))


def _new_request_to_proto(req: NewRequest) -> pb.NewRequest:
    return pb.NewRequest(
        req_id=req.req_id,
        token_ids=req.token_ids,
        num_prompt_tokens=req.num_prompt_tokens,
        num_computed_tokens=req.num_computed_tokens,
        block_ids=req.block_ids,
        sampling=sampling_spec_to_proto(req.sampling),
    )


def _new_request_from_proto(msg: pb.NewRequest) -> NewRequest:
    return NewRequest(
        req_id=msg.req_id,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_computed_tokens=msg.num_computed_tokens,
        block_ids=list(msg.block_ids),
        sampling=sampling_spec_from_proto(msg.sampling),
    )


def step_plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    msg = pb.StepPlan(
        step_id=plan.step_id,
        req_ids=plan.req_ids,
        num_tokens=plan.num_tokens,
        finished_req_ids=plan.finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
        sampled_token_ids=plan.sampled_token_ids,
    )
    if plan.new_requests:
        msg.new_requests.extend([_new_request_to_proto(r) for r in plan.new_requests])
    if plan.new_block_ids:
        add_blocks = msg.new_block_ids.add
        for req_id, block_ids in plan.new_block_ids.items():
            add_blocks(req_id=req_id, block_ids=block_ids)
    if plan.draft_token_ids:
        add_drafts = msg.draft_token_ids.add
        for req_id, token_ids in plan.draft_token_ids.items():
            add_drafts(req_id=req_id, token_ids=token_ids)
    return msg


def step_plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[_new_request_from_proto(r) for r in msg.new_requests],
        req_ids=list(msg.req_ids),
        num_tokens=list(msg.num_tokens),
        new_block_ids={b.req_id: list(b.block_ids) for b in msg.new_block_ids},
        finished_req_ids=list(msg.finished_req_ids),
        preempted_req_ids=list(msg.preempted_req_ids),
        draft_token_ids={d.req_id: list(d.token_ids) for d in msg.draft_token_ids},
        sampled_token_ids=list(msg.sampled_token_ids),
    )


def step_result_to_proto(result: StepResult, rank: int = 0, error: str = "") -> pb.StepResult:
    """`rank` and `error` are wire-only: which rank acknowledges the step, and why it refused it (if it did)."""
    msg = pb.StepResult(
        step_id=result.step_id,
        rank=rank,
        req_ids=result.req_ids,
        token_ids=result.token_ids,
        forward_ms=result.forward_ms,
        grammar_mask_ms=result.grammar_mask_ms,
        error=error,
    )
    if any(lp is not None for lp in result.logprobs):
        msg.logprobs.CopyFrom(_logprobs_to_columns(result.logprobs))
    if result.prompt_logprobs:
        msg.prompt_logprobs.extend([
            pb.PromptLogprobs(req_id=p.req_id, start=p.start, logprobs=_logprobs_to_columns(p.logprobs))
            for p in result.prompt_logprobs
        ])
    return msg


def _logprobs_to_columns(logprobs: list[TokenLogprobs | None]) -> pb.StepLogprobs:
    index: list[int] = []
    logprob: list[float] = []
    top_counts: list[int] = []
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: list[int] = []
    for i, lp in enumerate(logprobs):
        if lp is None:
            continue
        if len(lp.top_ids) != len(lp.top_logprobs):
            raise ValueError(f"entry {i}: {len(lp.top_ids)} top ids but {len(lp.top_logprobs)} top logprobs")
        index.append(i)
        logprob.append(lp.logprob)
        top_counts.append(len(lp.top_ids))
        top_ids += lp.top_ids
        top_logprobs += lp.top_logprobs
        rank.append(lp.rank)
    return pb.StepLogprobs(
        index=index, logprob=logprob, top_counts=top_counts, top_ids=top_ids, top_logprobs=top_logprobs, rank=rank
    )


def _logprobs_from_columns(columns: pb.StepLogprobs, size: int) -> list[TokenLogprobs | None]:
    logprobs: list[TokenLogprobs | None] = [None] * size
    if columns.index:
        top_ids = list(columns.top_ids)
        top_logprobs = list(columns.top_logprobs)
        start = 0
        for i, logprob, count, rank in zip(columns.index, columns.logprob, columns.top_counts, columns.rank):
            end = start + count
            logprobs[i] = TokenLogprobs(logprob, top_ids[start:end], top_logprobs[start:end], rank)
            start = end
    return logprobs


def step_result_from_proto(msg: pb.StepResult) -> StepResult:
    """The dataclass view (read `msg.rank` and `msg.error` on the message). `logprobs` always has one entry
    per request id, None where there are none, as plan.py asks: a result encoded with an empty list decodes so."""
    req_ids = list(msg.req_ids)
    return StepResult(
        step_id=msg.step_id,
        req_ids=req_ids,
        token_ids=list(msg.token_ids),
        logprobs=_logprobs_from_columns(msg.logprobs, len(req_ids)),
        prompt_logprobs=[
            PromptLogprobs(p.req_id, p.start, _logprobs_from_columns(p.logprobs, len(p.logprobs.index)))
            for p in msg.prompt_logprobs
        ],
        forward_ms=msg.forward_ms,
        grammar_mask_ms=msg.grammar_mask_ms,
    )


def engine_config_to_proto(config: EngineConfig) -> pb.EngineConfig:
    # Every EngineConfig field has a same-named proto field (a test checks it); None stays unset.
    return pb.EngineConfig(**{f.name: v for f in fields(config) if (v := getattr(config, f.name)) is not None})


def engine_config_from_proto(msg: pb.EngineConfig) -> EngineConfig:
    return EngineConfig(**message_fields(msg, [f.name for f in fields(EngineConfig)]))
