"""InProcessExecutor: the Executor for TP=1 in the caller's process (offline use and tests).

The same StepPlan/StepResult messages as every other executor, passed as Python objects: no sockets, no copies.
"""

from __future__ import annotations

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult
from shardserve.worker.model_runner import ModelRunner


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

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise RuntimeError("the executor was shut down")
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.runner = None  # frees the model and the cache with the last reference
