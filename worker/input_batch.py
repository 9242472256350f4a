"""Per-request worker state and one step's flat batch built from it: InputBatch owns both.

Plans carry deltas (proto/plan.py); InputBatch keeps what they add up to, per request (RequestState: token ids,
computed count, block table, sampling settings). The block tables also live on the device, one row per
request, changed only by the entries a plan adds (worker/block_tables.py). ModelRunner.launch_step calls
prepare(plan), which
  1. applies the plan's deltas (drop finished and preempted requests, add new ones, append new blocks), staging
     the device table's writes;
  2. checks every scheduled request and takes its positions [num_computed, num_computed + n): input ids,
     positions, context length, its table row, whether it samples;
  3. lays them out as one int64 host list (worker/step_inputs.py: pack_inputs) that a single copy moves to the
     device: into a fresh tensor (StepInputs.to_device, the eager forward), or, for a decode batch that a captured
     CUDA graph covers, padded to that graph's size, into the graph's static buffers (worker/cuda_graphs.py:
     DecodeGraphRunner.run). Either way the staged table writes are applied first, and the batch's rows are
     gathered from the table on the device.

Async scheduling: a sampled token stays on the device until its step is finished (worker/step_in_flight.py).
add_placeholders() appends a PENDING placeholder to each sampling request's token list and notes which step's
sampled ids (and which row) hold it; a later step computing that position gathers the value on the device into its
input ids (StepInputs.gather_pending, right after the inputs' copy), so a decode never waits for the host.
resolve_placeholders() writes the values over the placeholders once the step is read back: at finish_step, or
earlier for requests with penalties, which read token values on the host (sampling_rows). Everything else the
sampler needs (seeds, min_tokens) is the token lists' length.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from shardserve.proto.plan import StepPlan, cdiv
from shardserve.worker.block_tables import DeviceBlockTables
from shardserve.worker.logit_processors import uses_penalties
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.step_in_flight import StepInFlight
from shardserve.worker.step_inputs import RequestState, StepInputs, pack_inputs

PENDING = -1  # a token sampled on the device whose value the host has not read yet


class GraphSizes(Protocol):
    """What prepare() asks the decode graphs (worker/cuda_graphs.py: DecodeGraphRunner)."""

    def padded_size(self, num_seqs: int, max_seq_len: int) -> int | None: ...


class InputBatch:
    """Every request's state on this rank, each step's batch built from it, and the placeholders of the tokens
    sampled by steps still in flight."""

    def __init__(self, block_size: int, max_seqs: int = 64, max_blocks: int = 0, samples: bool = True) -> None:
        """max_seqs and max_blocks (per request) size the device block table; it grows past them if it must.
        samples: False on a pipeline stage before the last, which learns its requests' sampled tokens from the
        plans (StepPlan.sampled_token_ids) instead of sampling them."""
        self.block_size = block_size
        self.samples = samples
        self.requests: dict[str, RequestState] = {}
        self.tables = DeviceBlockTables(max_seqs, max_blocks)
        self.last_step_id = 0
        # step id -> (the launched step, its sampling requests, where each one's placeholder sits), until resolved
        self._in_flight: dict[int, tuple[StepInFlight, list[RequestState], list[int]]] = {}

    # ---- a plan -> the step's batch ------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, graphs: GraphSizes | None = None) -> StepInputs:
        """Applies the plan's deltas and builds its batch; a decode batch is padded for a graph that covers it."""
        self._apply_deltas(plan)
        if len(plan.req_ids) != len(plan.num_tokens):
            raise ValueError(f"plan {plan.step_id}: {len(plan.req_ids)} req_ids but {len(plan.num_tokens)} num_tokens")
        requests, bs = self.requests, self.block_size
        states: list[RequestState] = []
        sample_rows: list[int] = []
        sampling_states: list[RequestState] = []
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        table_rows: list[int] = []
        width = 0
        gathers: dict[int, tuple[list[int], list[int]]] = {}  # step id -> (input rows, rows of its sampled ids)
        for req_id, n in zip(plan.req_ids, plan.num_tokens):
            state = requests.get(req_id)
            if state is None:
                state = self._state(req_id)  # raises the KeyError that names the request
            token_ids, start = state.token_ids, state.num_computed
            end = start + n
            if n < 1 or end > len(token_ids):
                raise ValueError(f"request {req_id!r}: {n} tokens from {start} exceed its {len(token_ids)} tokens")
            num_blocks = cdiv(end, bs)
            if num_blocks > len(state.block_ids):
                raise ValueError(f"request {req_id!r}: {len(state.block_ids)} blocks cannot hold {end} tokens")
            if state.pending:
                for position, (step_id, row) in state.pending.items():
                    if start <= position < end:
                        dst, src = gathers.setdefault(step_id, ([], []))
                        dst.append(len(input_ids) + position - start)
                        src.append(row)
            if end == len(token_ids):
                sample_rows.append(len(states))
                sampling_states.append(state)
            states.append(state)
            if n == 1:  # a decode: no slice, no range
                input_ids.append(token_ids[start])
                positions.append(start)
            else:
                input_ids += token_ids[start:end]
                positions += range(start, end)
            query_lens.append(n)
            seq_lens.append(end)
            table_rows.append(state.table_row)
            if num_blocks > width:
                width = num_blocks
        for state, end in zip(states, seq_lens):
            state.num_computed = end
        padded, flat = None, []
        if states:
            if graphs is not None and len(input_ids) == len(states):  # decode only: one token per request
                padded = graphs.padded_size(len(states), max(seq_lens))
            flat = pack_inputs(input_ids, positions, table_rows, padded, seq_lens, query_lens)
        return StepInputs(
            states=states, sample_rows=sample_rows, sampling_states=sampling_states, flat=flat,
            num_tokens=len(input_ids), width=width, tables=self.tables, padded=padded, query_lens=query_lens,
            seq_lens=seq_lens, block_size=bs,
            gathers=[(self._in_flight[step_id][0].tokens, dst, src) for step_id, (dst, src) in gathers.items()],
        )

    def _apply_deltas(self, plan: StepPlan) -> None:
        """Drop finished/preempted, add new requests, append new blocks (plan.py's order)."""
        if plan.step_id != self.last_step_id + 1:
            raise RuntimeError(f"step plan {plan.step_id} after {self.last_step_id}: plans must arrive in order")
        self.last_step_id = plan.step_id
        tables = self.tables
        for req_id in itertools.chain(plan.finished_req_ids, plan.preempted_req_ids):
            state = self.requests.pop(req_id, None)
            if state is not None:
                tables.release(state.table_row)
        new_ids = set()
        for req in plan.new_requests:
            if req.req_id in self.requests:  # sent again without being dropped: its row is reused
                tables.release(self.requests[req.req_id].table_row)
            state = RequestState(
                token_ids=list(req.token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed=req.num_computed_tokens,
                block_ids=list(req.block_ids),
                sampling=req.sampling,
                table_row=tables.assign(),
            )
            self.requests[req.req_id] = state
            tables.write(state.table_row, 0, state.block_ids)
            new_ids.add(req.req_id)
        for req_id, blocks in plan.new_block_ids.items():
            if req_id in new_ids:
                continue  # a new request's block_ids is already its whole table at this step
            state = self._state(req_id)
            tables.write(state.table_row, len(state.block_ids), blocks)
            state.block_ids.extend(blocks)
        if not self.samples and plan.sampled_token_ids:
            for req_id, token in zip(plan.req_ids, plan.sampled_token_ids):
                if token >= 0:
                    self._state(req_id).token_ids.append(token)
        for req_id, drafts in plan.draft_token_ids.items():  # speculation: verified this step (spec_verify.py)
            self._state(req_id).token_ids.extend(drafts)

    def _state(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id!r} is scheduled but the worker has no state for it (never sent or dropped)")
        return state

    # ---- sampled tokens: placeholders until read back ------------------------------------------------------

    def sampling_rows(self, batch: StepInputs) -> list[SamplingRow]:
        """One SamplingRow per sampling request. Penalties and grammars (worker/grammar_matchers.py) read token
        values on the host: the placeholders of requests that use them are resolved first (their steps read back
        early, losing their overlap)."""
        for state in batch.sampling_states:
            if state.pending and (uses_penalties(state.sampling) or state.sampling.grammar_kind):
                for step_id, _ in list(state.pending.values()):
                    self._resolve(step_id)
        return [SamplingRow(s.sampling, s.token_ids, s.num_prompt_tokens) for s in batch.sampling_states]

    def add_placeholders(self, step: StepInFlight, batch: StepInputs) -> None:
        """Appends a placeholder per sampling request for the id step.tokens holds in its row (called at launch)."""
        positions = []
        for row, state in enumerate(batch.sampling_states):
            position = len(state.token_ids)
            state.pending[position] = (step.step_id, row)
            state.token_ids.append(PENDING)
            positions.append(position)
        self._in_flight[step.step_id] = (step, batch.sampling_states, positions)

    def resolve_placeholders(self, step: StepInFlight) -> None:
        """Writes a step's sampled ids over its placeholders (waits for that step only). No-op once resolved."""
        self._resolve(step.step_id)

    def _resolve(self, step_id: int) -> None:
        held = self._in_flight.pop(step_id, None)
        if held is None:
            return
        step, states, positions = held
        for state, position, value in zip(states, positions, step.read_tokens()):
            state.token_ids[position] = value
            state.pending.pop(position, None)
