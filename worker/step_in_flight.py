"""A step whose device work is queued but not yet read back: the worker's half of async scheduling.

ModelRunner.launch_step queues inputs, forward and sampling and returns a StepInFlight without waiting for the
device. The sampled tokens stay there: each sampling request's token list gets a PENDING placeholder, and the
request's `pending` map says which step's token tensor (and row) holds the value. When the next step computes that
position, fill_pending_inputs copies the value into its input ids on the device (stream order makes it ready),
so a decode never waits for the host. finish() is the one place that waits, for this step only: a CUDA event
recorded after a non-blocking copy of the tokens into pinned memory, so the host is not blocked on steps queued
after it. Then the placeholders get their values.

Where a value is needed on the host before that (repetition/presence/frequency penalties read the token ids),
read_tokens() is called early and that step loses its overlap; everything else (seeds, min_tokens) needs only
the list's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from shardserve.proto.plan import StepResult
from shardserve.worker.sampler import SamplingRow, device_tensor, token_logprobs, uses_penalties

PENDING = -1  # a token sampled on the device whose value the host has not read yet

if TYPE_CHECKING:

    class _TokenState(Protocol):  # ModelRunner's RequestState, as far as this file needs it
        token_ids: list[int]
        pending: dict[int, tuple["StepInFlight", int]]
        sampling: object


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on the device without a host sync (see sampler.device_tensor)."""
    return device_tensor(values, torch.int64, device)


@dataclass(slots=True, eq=False)
class StepInFlight:
    result: StepResult  # step_id and req_ids at launch; token_ids and logprobs once finished
    host_s: float = 0.0  # host time spent launching and finishing: StepResult.forward_ms off CUDA
    _started: torch.cuda.Event | None = None  # CUDA: recorded before the step's first kernel ...
    _stopped: torch.cuda.Event | None = None  # ... and after its last: forward_ms is the device time between
    tokens: torch.Tensor | None = None  # [n] int64 sampled ids on the device, one per result.req_ids entry
    _host_tokens: torch.Tensor | None = None  # their host copy, written by a queued non-blocking copy
    _ready: torch.cuda.Event | None = None  # recorded after that copy (CUDA only)
    _states: list["_TokenState"] = field(default_factory=list)  # the sampling requests, in result order
    _positions: list[int] = field(default_factory=list)  # where each one's placeholder sits in its token list
    _logprob_inputs: tuple[torch.Tensor, list[SamplingRow]] | None = None  # raw logits and rows, when asked
    _values: list[int] | None = None

    def hold(
        self, tokens: torch.Tensor, states: list["_TokenState"], logits: torch.Tensor, rows: list[SamplingRow]
    ) -> None:
        """Appends a placeholder per sampled token and queues the copy to the host (called at launch)."""
        self.tokens = tokens
        self._states = states
        for row, state in enumerate(states):
            position = len(state.token_ids)
            state.pending[position] = (self, row)
            state.token_ids.append(PENDING)
            self._positions.append(position)
        if any(r.spec.logprobs >= 0 for r in rows):
            self._logprob_inputs = (logits, rows)
        if tokens.is_cuda:
            self._host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host_tokens.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host_tokens = tokens

    def start_device_timer(self, device: torch.device) -> None:
        """CUDA: an event before the step's first kernel; with stop_device_timer() after its last, the step's
        forward_ms is the device time between them (the GPU's own time for the step, wherever the host was)."""
        if device.type == "cuda":
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()

    def stop_device_timer(self) -> None:
        if self._started is not None:
            self._stopped = torch.cuda.Event(enable_timing=True)
            self._stopped.record()

    def done(self) -> bool:
        """True once the step's tokens are in host memory (always on CPU, where launch computed them)."""
        return self._ready is None or self._ready.query()

    def read_tokens(self) -> list[int]:
        """Waits for this step's tokens (not for later steps) and writes them over the placeholders. Idempotent."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = self._host_tokens.tolist() if self._host_tokens is not None else []
            for state, position, value in zip(self._states, self._positions, self._values):
                state.token_ids[position] = value
                state.pending.pop(position, None)
        return self._values

    def finish(self) -> StepResult:
        started = time.perf_counter()
        if self.tokens is not None:
            self.result.token_ids = self.read_tokens()
            if self._logprob_inputs is not None:
                logits, rows = self._logprob_inputs
                self.result.logprobs = token_logprobs(logits, rows, self.tokens)
            else:
                self.result.logprobs = [None] * len(self._values)
        # Later steps that read these tokens on the device were queued already: the tensors can go.
        self.tokens = self._host_tokens = self._logprob_inputs = None
        self._states = []
        self.host_s += time.perf_counter() - started
        self.result.forward_ms = self.host_s * 1e3
        if self._stopped is not None:
            self._stopped.synchronize()  # recorded before the tokens' copy: already complete here
            self.result.forward_ms = self._started.elapsed_time(self._stopped)
        self._started = self._stopped = None
        return self.result


def read_back_for_penalties(states: list["_TokenState"]) -> None:
    """Penalties read token values on the host: resolve the placeholders of requests that use them."""
    for state in states:
        if state.pending and uses_penalties(state.sampling):
            for step, _ in list(state.pending.values()):
                step.read_tokens()


def fill_pending_inputs(input_ids: torch.Tensor, spans: list[tuple["_TokenState", int, int]]) -> None:
    """Copies placeholder values into the flat input ids on the device, from the tensors that sampled them.

    spans: (state, start, end) per batch entry, in the order their tokens sit in input_ids.
    """
    by_step: dict[StepInFlight, tuple[list[int], list[int]]] = {}
    offset = 0
    for state, start, end in spans:
        for position, (step, row) in state.pending.items():
            if start <= position < end:
                dst, src = by_step.setdefault(step, ([], []))
                dst.append(offset + position - start)
                src.append(row)
        offset += end - start
    for step, (dst, src) in by_step.items():
        index = to_device(dst + src, input_ids.device)
        input_ids.index_copy_(0, index[: len(dst)], step.tokens.index_select(0, index[len(dst) :]))
