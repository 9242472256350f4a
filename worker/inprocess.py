"""InProcessExecutor: the Executor for TP=1 in the caller's process (offline use and tests).

The same StepPlan/StepResult messages as every other executor, passed as Python objects: no sockets, no copies.
It drives the worker's step loop (worker/step_loop.py) directly: submit() launches a step's device work and
returns, collect() finishes the oldest launched step (ModelRunner.launch_step / finish_step). On CUDA that lets
the engine plan step N+1 while the GPU runs step N, and step N+1 takes step N's sampled tokens as inputs on the
device. On CPU submit() computes the step eagerly. A step that raises re-raises its exception here; after it
(or after a refused plan) the loop's rules apply as on any worker.
"""

from __future__ import annotations

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult
from shardserve.worker.model_runner import ModelRunner
from shardserve.worker.step_loop import StepLoop, StepRefusal


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"InProcessExecutor runs tensor_parallel_size 1, got {config.tensor_parallel_size}: "
                "use local worker processes (shardserve.api.local_executors.create_executor)"
            )
        self.config = config
        self.runner: ModelRunner | None = ModelRunner(config, rank=0)
        self.num_kv_blocks: int = self.runner.profile_num_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self.steps = StepLoop(self.runner, rank=0)

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Launches the plan's step; returns without waiting for the device. Plans go in step-id order."""
        refusal = self.steps.launch(plan)
        if refusal is not None:
            raise refusal.as_exception()

    def collect(self) -> StepResult:
        """The oldest submitted step's result (waits for that step only)."""
        if not self.steps.num_launched:
            raise RuntimeError("collect() without a submitted step")
        answer = self.steps.finish()
        if isinstance(answer, StepRefusal):
            raise answer.as_exception()
        return answer

    def shutdown(self) -> None:
        self.steps.stop()
        self.runner = None  # frees the model and the cache with the last reference
