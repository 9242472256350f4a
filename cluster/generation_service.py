"""The client-facing gRPC service: the Generation servicer, grpc.health.v1 Health, server reflection, and the
mapping from the controller's exceptions to gRPC status codes. A front (cluster/front.py) starts it and
is what it serves, through the GenerationBackend interface below.

A GenerateRequest becomes a prompt and SamplingParams by field names (every SamplingParams field is a
GenerateRequest field; a test checks it); the request itself is checked where every front end's requests are, at
admission (cluster/admission.py), so this file only rejects what a message cannot say otherwise (no prompt, an
empty chat).

Status mapping: bad input (ValueError) -> INVALID_ARGUMENT with its message (cut to 1 KiB); not serving (starting, draining,
failed) -> UNAVAILABLE; too many live requests -> RESOURCE_EXHAUSTED; an unknown id on Abort -> NOT_FOUND;
anything else -> INTERNAL. A user's error only ever ends that user's call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardserve.cluster.api_security import ApiSecurity
from shardserve.cluster.controller_types import LiveRequest, ServedModel
from shardserve.cluster.engine import EngineStats
from shardserve.cluster.errors import ServerOverloaded, ServerUnavailable, UnknownRequest, bounded, excerpt
from shardserve.cluster.outputs import RequestDelta, top_entries
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.proto import generation_pb2 as pb
from shardserve.proto import generation_pb2_grpc as pb_grpc
from shardserve.proto.config import EngineConfig
from shardserve.proto.convert import message_fields
from shardserve.proto.request_fields import chat_from_proto, structured_outputs_dict
from shardserve.proto.transport import host_port

log = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass
class ModelFacts:
    """What GetModelInfo reports."""

    engine: EngineConfig
    model: ServedModel
    num_replicas: int
    has_chat_template: bool


class GenerationBackend(Protocol):
    """What the servicer asks of the process serving requests (cluster/front.py: Front)."""

    stream_interval: int  # after a stream's first tokens, one message per this many tokens
    max_live_requests: int  # its admission limit (also sizes the server's concurrent streams)

    async def add_request(self, prompt, params: SamplingParams, req_id: str | None = None,
                          resumed: list[int] | None = None, echo: bool = False) -> LiveRequest: ...

    async def abort(self, req_id: str) -> None: ...

    def cancel(self, req_id: str) -> None: ...

    def note_rejected(self) -> None: ...

    async def server_stats(self) -> tuple[EngineStats | None, dict]: ...

    def model_facts(self) -> ModelFacts: ...


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and its message, never over MAX_MESSAGE_BYTES: the message travels in the call's trailers, and
    past gRPC's metadata limit the client gets RESOURCE_EXHAUSTED with the reason lost."""
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(error))
    if isinstance(error, ServerUnavailable):
        return grpc.StatusCode.UNAVAILABLE, bounded(str(error))
    if isinstance(error, ServerOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(str(error))
    if isinstance(error, UnknownRequest):
        return grpc.StatusCode.NOT_FOUND, f"no live request has id {excerpt(error.args[0])}"
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {error!r}")


def request_from_proto(msg: pb.GenerateRequest) -> tuple[object, SamplingParams, str | None]:
    """(prompt, sampling params, request id or None); raises ValueError for bad input. Sampling fields left unset
    take SamplingParams' defaults."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        prompt = msg.text
    elif kind == "token_ids":
        prompt = list(msg.token_ids.ids)
    elif kind == "chat":
        prompt = chat_from_proto(msg.chat)
    else:
        raise ValueError("the request has no prompt: set text, token_ids or chat")
    fields = message_fields(msg, _SAMPLING_FIELDS)
    if "structured_outputs" in fields:
        fields["structured_outputs"] = structured_outputs_dict(msg.structured_outputs)
    params = SamplingParams(**{"max_tokens": None, **fields})  # unset: the rest
    return prompt, params, msg.request_id if msg.HasField("request_id") else None


def delta_to_proto(delta: RequestDelta, params: SamplingParams) -> pb.GenerateResponse:
    """A delta, with its logprobs (vLLM's dicts) as TokenLogprob messages: the chosen token and the top N asked."""
    msg = pb.GenerateResponse()
    msg.delta.text = delta.text
    msg.delta.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        _add_logprobs(msg.delta.logprobs, delta.logprobs, params.logprobs or 0)
    if delta.prompt_logprobs:
        _add_logprobs(msg.delta.prompt_logprobs, delta.prompt_logprobs, params.prompt_logprobs or 0)
    return msg


def merged_delta_to_proto(deltas: list[RequestDelta], params: SamplingParams) -> pb.GenerateResponse:
    """Consecutive deltas of one request as one Delta message (text and token ids concatenated, logprobs in
    order; prompt logprobs come only on a request's first delta)."""
    msg = delta_to_proto(deltas[0], params)
    for delta in deltas[1:]:
        msg.delta.text += delta.text
        msg.delta.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            _add_logprobs(msg.delta.logprobs, delta.logprobs, params.logprobs or 0)
    return msg


def _add_logprobs(field, entries, n: int) -> None:
    """Each position's dict starts with its own token (cluster/outputs.py: position_logprobs)."""
    for entry in entries:
        if entry is None:
            continue
        token, chosen = next(iter(entry.items()))
        lp = field.add(token_id=token, logprob=chosen.logprob, text=chosen.decoded_token or "", rank=chosen.rank or 0)
        for top_id, top in top_entries(entry, n):
            lp.top_logprobs.add(token_id=top_id, logprob=top.logprob, text=top.decoded_token or "")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, backend: GenerationBackend) -> None:
        self.backend = backend

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            prompt, params, req_id = request_from_proto(request)
        except ValueError as e:
            self.backend.note_rejected()
            await context.abort(*status_of(e))
        try:
            live = await self.backend.add_request(prompt, params, req_id, resumed=list(request.resume_token_ids),
                                                     echo=request.echo)
        except (ValueError, ServerUnavailable, ServerOverloaded) as e:  # counted as rejected by the front
            await context.abort(*status_of(e))
        finished = False
        try:
            yield pb.GenerateResponse(
                started=pb.GenerateResponse.Started(request_id=live.req_id,
                                                    prompt_token_count=live.num_prompt_tokens, seed=live.seed,
                                                    prompt_text=live.prompt_text,
                                                    prompt_first_token_text=live.prompt_first_token_text)
            )
            interval, sent = self.backend.stream_interval, 0
            while True:
                # Deltas queued meanwhile (the stream fell behind the engine) go out as one message: under load a
                # message costs the server and the client more than its tokens do. With a stream interval > 1,
                # after the first tokens it also waits for that many tokens (or the end) before sending.
                items, num_tokens = [], 0
                while True:
                    items.append(await live.queue.get() if not items or live.queue.empty() else live.queue.get_nowait())
                    if isinstance(items[-1], BaseException) or items[-1].delta.finished:
                        break
                    num_tokens += len(items[-1].delta.token_ids)
                    if live.queue.empty() and (sent == 0 or num_tokens >= interval):
                        break
                sent += num_tokens
                item = items.pop()
                deltas = [i.delta for i in items] + ([] if isinstance(item, BaseException) else [item.delta])
                if any(d.token_ids or d.text or d.prompt_logprobs for d in deltas):
                    yield merged_delta_to_proto(deltas, params)
                if isinstance(item, BaseException):
                    finished = True  # the front has already forgotten it
                    await context.abort(*status_of(item))
                if item.delta.finished:
                    finished = True
                    d = item.delta
                    yield pb.GenerateResponse(finished=pb.GenerateResponse.Finished(
                        finish_reason=FINISH_REASONS.get(d.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                        usage=pb.Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_generated,
                                       cached_prompt_tokens=d.num_cached_tokens),
                        replica=live.replica.id,
                        stop_reason="" if d.stop_reason is None else str(d.stop_reason),
                    ))
                    return
        finally:
            if not finished:  # the client cancelled or its deadline passed: free the request's blocks
                self.backend.cancel(live.req_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            await self.backend.abort(request.request_id)
        except (UnknownRequest, ServerUnavailable) as e:
            await context.abort(*status_of(e))
        return pb.AbortResponse()

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        facts = self.backend.model_facts()
        cfg, model = facts.engine, facts.model
        info = pb.ModelInfo(
            model=model.name,
            architecture=model.architecture,
            max_model_len=cfg.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=model.eos_token_ids,
            has_chat_template=facts.has_chat_template,
            tokenizer=model.name if cfg.tokenizer else "",  # the model's own; never a server path
            tensor_parallel_size=cfg.tensor_parallel_size,
            replicas=facts.num_replicas,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
        )
        if model.bos_token_id is not None:
            info.bos_token_id = model.bos_token_id
        return info

    async def GetServerStats(self, request, context: grpc.aio.ServicerContext) -> pb.ServerStats:
        try:
            stats, counters = await self.backend.server_stats()
        except Exception as e:  # the engine loop died between the state check and the call
            await context.abort(*status_of(ServerUnavailable(str(e))))
        msg = pb.ServerStats(
            requests_aborted=counters["requests_aborted"],
            requests_rejected=counters["requests_rejected"],
            uptime_s=counters["uptime_s"],
        )
        if stats is not None:
            msg.num_waiting = stats.num_waiting
            msg.num_running = stats.num_running
            msg.kv_blocks_total = stats.num_kv_blocks
            msg.kv_blocks_used = stats.num_kv_blocks_used
            msg.kv_blocks_cached = stats.num_kv_blocks_cached
            msg.requests_finished = stats.num_finished
            msg.prompt_tokens_total = stats.num_prompt_tokens
            msg.generation_tokens_total = stats.num_generated_tokens
            msg.spec_decode_num_drafts = stats.spec_num_drafts
            msg.spec_decode_num_draft_tokens = stats.spec_num_draft_tokens
            msg.spec_decode_num_accepted_tokens = stats.spec_num_accepted_tokens
            msg.spec_decode_num_accepted_tokens_per_pos.extend(stats.spec_accepted_per_pos)
            msg.spec_decode_acceptance_rate = stats.spec_acceptance_rate
            msg.spec_decode_mean_acceptance_length = stats.spec_mean_acceptance_length
        for replica in counters["replicas"]:
            row = msg.replicas.add(id=replica["id"], state=replica["state"], requests_routed=replica["routed"])
            if (s := replica["stats"]) is not None:
                row.num_waiting, row.num_running = s.num_waiting, s.num_running
                row.kv_blocks_total, row.kv_blocks_used = s.num_kv_blocks, s.num_kv_blocks_used
                row.kv_blocks_cached, row.requests_finished = s.num_kv_blocks_cached, s.num_finished
                row.prompt_tokens_total = s.num_prompt_tokens
                row.cached_prompt_tokens_total = s.num_cached_prompt_tokens
                row.generation_tokens_total = s.num_generated_tokens
        return msg


async def start_server(backend: GenerationBackend, host: str, port: int, security: ApiSecurity | None = None):
    """Starts the grpc.aio server on host:port (0 = a free port), with the token, TLS and size limit `security`
    gives (cluster/api_security.py). Returns (server, bound port, health servicer); health starts NOT_SERVING."""
    security = security or ApiSecurity()
    server = grpc.aio.server(interceptors=security.interceptors(),
                             options=security.server_options(backend.max_live_requests))
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(backend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        bound = security.bind(server, host_port(host, port))
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind the gRPC server to {host_port(host, port)}: {e}") from e
    if bound == 0:
        raise RuntimeError(f"cannot bind the gRPC server to {host_port(host, port)}")
    await server.start()
    await set_health(health_servicer, False)
    return server, bound, health_servicer


async def set_health(health_servicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", GENERATION_SERVICE):  # "" is the whole server, as grpc health probes ask by default
        await health_servicer.set(service, status)
