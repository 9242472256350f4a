"""ModelRunner: one rank's model and KV cache, and the step: plan -> input tensors -> forward -> logits -> tokens.

It keeps each request's state as proto/plan.py specifies (token ids, computed count, block table, sampling
settings), so plans carry only deltas. Every rank runs the same steps on the same state and samples the same
token (the sampler is deterministic given the seed), so rank 0's result speaks for all.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from shardserve.kernels.backend_choice import get_backend
from shardserve.kernels.backends import AttentionMetadata
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import SamplingSpec, StepPlan, StepResult
from shardserve.worker import cuda_graphs, kv_cache
from shardserve.worker.sampler import SamplingRow, device_tensor, sample, sample_tokens
from shardserve.worker.step_in_flight import StepInFlight, fill_pending_inputs, read_back_for_penalties, to_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "cuda":
        # Local processes see every GPU (rank i takes GPU i); a Ray actor sees only its own (index 0).
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # prompt + generated, including the tokens sampled here (PENDING until read back)
    num_prompt_tokens: int
    num_computed: int  # positions whose KV is in the cache
    block_ids: list[int]
    sampling: SamplingSpec
    pending: dict[int, tuple[StepInFlight, int]] = field(default_factory=dict)  # position -> (step, row) holding it


@dataclass(slots=True)
class _Scheduled:
    state: RequestState
    start: int  # first position computed this step
    end: int  # one past the last


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        from transformers import AutoConfig

        from shardserve.worker.loader import init_dummy_weights, load_weights
        from shardserve.worker.models.registry import build_model

        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        self.attn_backend = get_backend(config.attention_backend, self.device.type)
        self.model = build_model(self.hf_config, self.dtype, self.device, self.attn_backend)
        with torch.inference_mode():
            if config.load_format == "dummy":
                init_dummy_weights(self.model, config.seed)
            else:
                load_weights(self.model, config.model)
        if self.device.type == "cuda":  # before any graph capture: the decode graphs record whichever path is on
            from shardserve.worker.distributed import enable_one_shot_all_reduce

            enable_one_shot_all_reduce(self.dtype, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.requests: dict[str, RequestState] = {}
        self.last_step_id = 0
        self.decode_graphs: cuda_graphs.DecodeGraphRunner | None = None  # captured by allocate_kv_cache on CUDA
        self._graph_reserve: int | None = None  # bytes the KV sizing left for the graphs (measured)

    # ------------------------------------------------------------------------------------------ cache

    def profile_num_blocks(self) -> int:
        blocks = kv_cache.profile_num_blocks(self.config, self.model, self.dtype, self.device, self._profile_forward)
        blocks, self._graph_reserve = cuda_graphs.leave_room_for_graphs(
            blocks, self.model, self.attn_backend, self.config, self.device, self.dtype
        )
        return blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.decode_graphs = None  # graphs over an earlier cache go first
        self.kv_caches = []  # drop an earlier cache before allocating the new one
        self.kv_caches = kv_cache.allocate_kv_cache(self.model, num_blocks, self.block_size, self.dtype, self.device)
        self.num_blocks = num_blocks
        if cuda_graphs.graphs_unsupported_reason(self.config, self.device, self.attn_backend) is None:
            self.decode_graphs = cuda_graphs.capture_decode_graphs(
                self.model, self.kv_caches, self.attn_backend, self.config, self.device, self._graph_reserve
            )

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """The largest step the scheduler may plan: max_num_batched_tokens of prefill, then logits and sampling
        for up to max_num_seqs rows, on a throwaway cache just big enough for one sequence."""
        total = self.config.max_num_batched_tokens
        seq_len = min(total, self.config.max_model_len)
        blocks = list(range(-(-seq_len // self.block_size)))
        scratch = kv_cache.allocate_kv_cache(self.model, len(blocks), self.block_size, self.dtype, self.device)
        batch, left = [], total
        while left > 0:
            n = min(seq_len, left)
            state = RequestState([0] * n, n, 0, blocks, SamplingSpec(temperature=1.0, top_p=0.9))
            batch.append(_Scheduled(state, 0, n))
            left -= n
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, scratch, meta)
        rows = min(self.config.max_num_seqs, total)
        logits = self.model.compute_logits(hidden[-rows:])
        state = batch[0].state
        sample(logits, [SamplingRow(state.sampling, state.token_ids, 0)] * rows)
        del scratch, hidden, logits

    # ------------------------------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish_step(self.launch_step(plan))

    @torch.inference_mode()
    def launch_step(self, plan: StepPlan) -> StepInFlight:
        """Queues the step's device work (inputs, forward, sampling) without waiting for it. The sampled tokens stay
        on the device as placeholders the next step reads there (worker/step_in_flight.py); finish_step reads them."""
        started = time.perf_counter()
        self._apply_deltas(plan)
        batch = self._schedule(plan)
        step = StepInFlight(StepResult(step_id=plan.step_id))
        if batch:
            step.start_device_timer(self.device)
            hidden, ends = self._forward(batch)
            sampling_rows = [i for i, s in enumerate(batch) if s.end == len(s.state.token_ids)]
            if sampling_rows:
                index = ends[to_device(sampling_rows, self.device)] if len(sampling_rows) < len(batch) else ends
                logits = self.model.compute_logits(hidden[index])
                states = [batch[i].state for i in sampling_rows]
                read_back_for_penalties(states)
                rows = [SamplingRow(s.sampling, s.token_ids, s.num_prompt_tokens) for s in states]
                tokens = sample_tokens(logits, rows)
                # Timed steps are the ones that sample: finish_step waits for those anyway (their tokens), while a
                # prefill-chunk step's finish must not wait for the device.
                step.stop_device_timer()
                step.hold(tokens, states, logits, rows)
                step.result.req_ids = [plan.req_ids[i] for i in sampling_rows]
            for s in batch:
                s.state.num_computed = s.end
        step.host_s = time.perf_counter() - started
        return step

    @torch.inference_mode()
    def finish_step(self, step: StepInFlight) -> StepResult:
        """Waits for a launched step's tokens (only its own) and returns its result. Finish steps in launch order."""
        return step.finish()

    def _forward(self, batch: list[_Scheduled]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hidden states and the row of each sequence's last token in them: a captured CUDA graph
        replays a decode-only batch it covers (worker/cuda_graphs.py); anything else runs eagerly."""
        spans = [(s.state, s.start, s.end) for s in batch]
        if self.decode_graphs is not None and all(s.end - s.start == 1 for s in batch):
            hidden = self.decode_graphs.run(
                [s.state.token_ids[s.start] for s in batch],
                [s.start for s in batch],
                [s.state.block_ids[: -(-s.end // self.block_size)] for s in batch],
                fill_inputs=lambda input_ids: fill_pending_inputs(input_ids, spans),
            )
            if hidden is not None:
                return hidden, self.decode_graphs.rows(len(batch))
        input_ids, positions, meta = self._prepare(batch)
        fill_pending_inputs(input_ids, spans)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, meta.query_start_loc[1:].long() - 1

    def _apply_deltas(self, plan: StepPlan) -> None:
        """Drop finished/preempted, add new requests, append new blocks (plan.py's order)."""
        if plan.step_id != self.last_step_id + 1:
            raise RuntimeError(f"step plan {plan.step_id} after {self.last_step_id}: plans must arrive in order")
        self.last_step_id = plan.step_id
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            self.requests.pop(req_id, None)
        new_ids = set()
        for req in plan.new_requests:
            self.requests[req.req_id] = RequestState(
                token_ids=list(req.token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed=req.num_computed_tokens,
                block_ids=list(req.block_ids),
                sampling=req.sampling,
            )
            new_ids.add(req.req_id)
        for req_id, blocks in plan.new_block_ids.items():
            if req_id in new_ids:
                continue  # a new request's block_ids is already its whole table at this step
            self._state(req_id).block_ids.extend(blocks)

    def _state(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id!r} is scheduled but the worker has no state for it (never sent or dropped)")
        return state

    def _schedule(self, plan: StepPlan) -> list[_Scheduled]:
        if len(plan.req_ids) != len(plan.num_tokens):
            raise ValueError(f"plan {plan.step_id}: {len(plan.req_ids)} req_ids but {len(plan.num_tokens)} num_tokens")
        batch = []
        requests, bs = self.requests, self.block_size
        for req_id, n in zip(plan.req_ids, plan.num_tokens):
            state = requests.get(req_id)
            if state is None:
                state = self._state(req_id)  # raises the KeyError that names the request
            end = state.num_computed + n
            if n < 1 or end > len(state.token_ids):
                raise ValueError(
                    f"request {req_id!r}: {n} tokens from {state.num_computed} exceed its {len(state.token_ids)} tokens"
                )
            if -(-end // bs) > len(state.block_ids):
                raise ValueError(f"request {req_id!r}: {len(state.block_ids)} blocks cannot hold {end} tokens")
            batch.append(_Scheduled(state, state.num_computed, end))
        return batch

    def _prepare(self, batch: list[_Scheduled]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Host lists -> one int64 tensor -> one copy to the device -> views (input ids, positions, metadata)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for s in batch:
            state, start, end = s.state, s.start, s.end
            input_ids += state.token_ids[start:end]
            positions += range(start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(state.block_ids[: -(-end // bs)])
        num_tokens, num_seqs = len(input_ids), len(batch)
        width = max(len(t) for t in tables)
        # Every section starts 16-byte aligned (an even int64 offset): Triton specialises kernels on pointer
        # alignment, and a positions view at an odd offset would compile a second RoPE variant mid-run.
        gap = [0] * (num_tokens % 2)
        flat = input_ids + gap + positions + gap + [0, *itertools.accumulate(query_lens)] + seq_lens
        for t in tables:
            flat += t
            if len(t) < width:
                flat += [0] * (width - len(t))
        dev = device_tensor(flat, torch.int64, self.device)
        span = num_tokens + len(gap)
        ids_t = dev[:num_tokens]
        pos_t = dev[span : span + num_tokens]
        offset = 2 * span
        query_start_loc = dev[offset : offset + num_seqs + 1].to(torch.int32)
        offset += num_seqs + 1
        seq_lens_t = dev[offset : offset + num_seqs].to(torch.int32)
        offset += num_seqs
        block_tables = dev[offset:].view(num_seqs, width)
        # slot of token j of sequence i: its block (from the table, by position) * block_size + offset in block.
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=self.device), query_start_loc.diff(), output_size=num_tokens
        )
        slot_mapping = block_tables[seq_of_token, pos_t // bs] * bs + pos_t % bs
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=block_tables.to(torch.int32),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return ids_t, pos_t, meta
