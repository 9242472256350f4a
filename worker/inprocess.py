"""InProcessExecutor: the Executor for TP=1 in the caller's process (offline use and tests).

The same StepPlan/StepResult messages as every other executor, passed as Python objects: no sockets, no copies.
submit() queues a step's device work and returns; collect() waits for the oldest submitted step's tokens only
(ModelRunner.launch_step / finish_step). On CUDA that lets the engine plan step N+1 while the GPU runs step N, and
step N+1 takes step N's sampled tokens as inputs on the device. On CPU submit() computes the step eagerly.
"""

from __future__ import annotations

from collections import deque

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult
from shardserve.worker.model_runner import ModelRunner
from shardserve.worker.step_in_flight import StepInFlight


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"InProcessExecutor runs tensor_parallel_size 1, got {config.tensor_parallel_size}: "
                "use MultiprocExecutor (worker/multiproc.py)"
            )
        self.config = config
        self.runner: ModelRunner | None = ModelRunner(config, rank=0)
        self.num_kv_blocks: int = self.runner.profile_num_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self._in_flight: deque[StepInFlight] = deque()  # submitted, not collected; oldest first

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Queues the plan's step; returns without waiting for the device. Plans go in step-id order."""
        if self.runner is None:
            raise RuntimeError("the executor was shut down")
        self._in_flight.append(self.runner.launch_step(plan))

    def collect(self) -> StepResult:
        """The oldest submitted step's result (waits for that step only)."""
        if self.runner is None:
            raise RuntimeError("the executor was shut down")
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        return self.runner.finish_step(self._in_flight.popleft())

    def shutdown(self) -> None:
        self._in_flight.clear()
        self.runner = None  # frees the model and the cache with the last reference
