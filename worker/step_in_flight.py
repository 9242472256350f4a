"""A step whose device work is queued but not yet read back: the worker's half of async scheduling.

ModelRunner.launch_step queues inputs, forward and sampling and returns a StepInFlight without waiting for the
device. It owns the step's sampled ids (`tokens`, on the device) until finish_step: their host copy is queued
at launch (pinned memory, non-blocking) with an event recorded after it, so read_tokens() waits for this step only,
not for steps queued after it. Meanwhile the requests' token lists hold PENDING placeholders for these ids, and
the next step gathers its input ids from `tokens` on the device; worker/input_batch.py keeps that bookkeeping and
writes the values over the placeholders once they are read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardserve.proto.plan import PromptLogprobs, StepResult
from shardserve.worker.device_copy import copy_to_host
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.token_logprobs import logprobs_of, token_logprobs


@dataclass(slots=True, eq=False)
class StepInFlight:
    result: StepResult  # step_id and req_ids at launch; token_ids and logprobs once finished
    host_s: float = 0.0  # host time spent launching and finishing: StepResult.forward_ms off CUDA
    _started: torch.cuda.Event | None = None  # CUDA: recorded before the step's first kernel ...
    _stopped: torch.cuda.Event | None = None  # ... and after its last: forward_ms is the device time between
    tokens: torch.Tensor | None = None  # [n] int64 sampled ids on the device, one per result.req_ids entry
    _host_tokens: torch.Tensor | None = None  # their host copy, written by a queued non-blocking copy
    _ready: torch.cuda.Event | None = None  # recorded after that copy (CUDA only)
    _logprob_inputs: tuple[torch.Tensor, list[SamplingRow]] | None = None  # raw logits and rows, when asked
    _values: list[int] | None = None
    _prompt_inputs: tuple | None = None  # (spans, logits, targets, top_n) of prompt logprobs, when asked

    @property
    def step_id(self) -> int:
        return self.result.step_id

    def hold(self, tokens: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Keeps the sampled ids (and what logprobs need) and queues their copy to the host (called at launch)."""
        self.tokens = tokens
        if any(r.spec.logprobs >= 0 for r in rows):
            self._logprob_inputs = (logits, rows)
        self._host_tokens, self._ready = copy_to_host(tokens)

    def hold_prompt_logits(self, spans: list[tuple[str, int, int]], logits: torch.Tensor, targets: torch.Tensor,
                           top_n: list[int]) -> None:
        """Keeps the logits of prompt positions (worker/model_runner.py: prompt_logprob_rows) until finish."""
        self._prompt_inputs = (spans, logits, targets, top_n)

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
        """Waits for this step's tokens (not for later steps) and returns them. Idempotent."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = self._host_tokens.tolist() if self._host_tokens is not None else []
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
        if self._prompt_inputs is not None:
            spans, logits, targets, top_n = self._prompt_inputs
            entries, start = logprobs_of(logits, targets, top_n), 0
            for req_id, first, count in spans:
                self.result.prompt_logprobs.append(PromptLogprobs(req_id, first, entries[start : start + count]))
                start += count
        # Later steps that read these tokens on the device were queued already: the tensors can go.
        self.tokens = self._host_tokens = self._logprob_inputs = self._prompt_inputs = None
        self.host_s += time.perf_counter() - started
        self.result.forward_ms = self.host_s * 1e3
        if self._stopped is not None:
            self._stopped.synchronize()  # recorded before the tokens' copy: already complete here
            self.result.forward_ms = self._started.elapsed_time(self._stopped)
        self._started = self._stopped = None
        return self.result
