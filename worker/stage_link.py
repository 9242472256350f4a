"""StageLink: a pipeline stage's forward, and the activations it takes from the stage before it and hands on.

Between stages the residual stream crosses as one tensor per step: hidden states and residual stacked as
[2, tokens, hidden] in the model's dtype, sent with torch.distributed point to point (gloo on CPU, NCCL on CUDA)
from each rank to the rank holding the same TP slice in the next stage (global rank + tp). After a decoder layer
the hidden states are whole on every TP rank (the row-parallel all-reduce made them so), so each TP rank already
holds what its peer needs: tp parallel transfers of the same bytes, no gather or re-split at the boundary and no
collective across stages (docs/architecture.md says why).

The receiver knows the shape from the plan (its token count), so no header travels. Sends are asynchronous
(isend): a stage hands its output on and takes its next plan while the next stage computes; the tensor is kept
until its send completes. Messages carry the step id as their tag (gloo matches by tag; NCCL keeps order per
pair), and every stage runs the plans in step order, so step N's activations meet step N's receive.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from shardserve.proto.stages import PipelineStage

_TAG_SPACE = 1 << 20  # gloo tags are ints: the step id modulo this (far more than the plans ever in flight)


class StageLink:
    def __init__(self, stage: PipelineStage, rank: int, tp: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.stage = stage
        self.prev_rank = None if stage.is_first else rank - tp  # the same TP slice, one stage back
        self.next_rank = None if stage.is_last else rank + tp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()  # in flight, oldest first
        self.wait_s = 0.0  # time spent waiting for the previous stage's activations since take_wait_s()

    def receive(self, step_id: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden states, residual) of this step: [num_tokens, hidden] each."""
        import time

        buffer = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        started = time.perf_counter()
        dist.recv(buffer, src=self.prev_rank, tag=step_id % _TAG_SPACE)
        self.wait_s += time.perf_counter() - started
        return buffer[0], buffer[1]

    def take_wait_s(self) -> float:
        """The time spent waiting in receive() since the last call: a step's host time less it is the stage's own
        work (StepResult.forward_ms), which the executor sums per rank to measure each stage's bubble."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def send(self, step_id: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Hands this stage's output on to the next stage without waiting for it to be taken."""
        if residual is None:  # x is the whole residual stream (the one-row layer): the next layer adds 0 to it
            x, residual = torch.zeros_like(x), x
        self._reap()
        payload = torch.stack((x, residual))
        self._sends.append((dist.isend(payload, dst=self.next_rank, tag=step_id % _TAG_SPACE), payload))

    def _reap(self) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()[0].wait()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for the sends still in flight; used when the stage stops."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._sends and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.001)
        self._sends.clear()


def stage_forward(model: torch.nn.Module, link: StageLink | None, step_id: int, input_ids: torch.Tensor,
                  positions: torch.Tensor, kv_caches: list, meta) -> torch.Tensor | None:
    """This stage's part of a step: the whole model without a link; else the stage's layers on the previous stage's
    activations (the embedding on the first stage), handing the result on, or the final hidden states on the last
    stage. None on a stage that hands its output on."""
    if link is None:
        return model(input_ids, positions, kv_caches, meta)
    carried = None if link.stage.is_first else link.receive(step_id, input_ids.shape[0])
    out = model(input_ids, positions, kv_caches, meta, carried=carried)
    if link.stage.is_last:
        return out
    link.send(step_id, *out)
    return None
