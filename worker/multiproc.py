"""MultiprocExecutor: tensor parallelism as local processes (spawned), one ModelRunner per rank.

The parent sends each plan to every rank over a pipe (submit) and reads the answers later (collect), so the
engine can plan the next step meanwhile; every rank runs the steps in order (the collectives inside the
model join them) and answers: rank 0 with the StepResult, the others with the step id only (their sampled tokens
are the same, see worker/sampler.py). A rank that raises answers with its traceback instead; a rank that dies
closes its sentinel. The parent waits with a deadline on all of it, so a failure surfaces as WorkerError, never
as a hang. The cluster issue replaces the pipes with gRPC streams to Ray actors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import StepPlan, StepResult

# Multicast over NVLink must stay off on the multi-GPU hosts (see the environment notes).
_CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(RuntimeError):
    """A rank failed, died or did not answer in time; the executor is unusable afterwards."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    """One rank: join the group, build the runner, then serve ("allocate", n), ("step", plan), ("shutdown", None).
    Steps are answered in order, each once the next one is launched or nothing else is waiting."""
    import torch

    from shardserve.worker.distributed import destroy_distributed, init_distributed
    from shardserve.worker.model_runner import ModelRunner

    for key, value in _CHILD_ENV.items():
        os.environ.setdefault(key, value)
    tp = config.tensor_parallel_size
    try:
        if config.device == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # the ranks share the host's cores
        backend = "nccl" if config.device == "cuda" else "gloo"
        init_distributed(rank, tp, init_method, backend, config.dist_timeout_s)
        runner = ModelRunner(config, rank)
        conn.send(("ok", runner.profile_num_blocks()))
        launched: deque = deque()  # steps queued on the device, not answered yet (at most two)

        def answer_oldest() -> None:
            result = runner.finish_step(launched.popleft())
            conn.send(("ok", result if rank == 0 else result.step_id))

        while True:
            # With the next plan already here, launch it before answering the previous one (the device stays
            # busy while this rank waits for and sends the older result); otherwise answer now.
            if launched and not conn.poll(0):
                answer_oldest()
                continue
            kind, payload = conn.recv()
            if kind == "step":
                launched.append(runner.launch_step(payload))
                if len(launched) > 1:
                    answer_oldest()
                continue
            while launched:
                answer_oldest()
            if kind == "allocate":
                runner.allocate_kv_cache(payload)
                conn.send(("ok", None))
            elif kind == "shutdown":
                break
            else:
                raise ValueError(f"unknown message {kind!r}")
    except (EOFError, KeyboardInterrupt):
        return  # the parent is gone: nothing to report to
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        return
    destroy_distributed(timeout_s=5.0)
    conn.send(("ok", None))


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0, step_timeout_s: float = 600.0) -> None:
        self.config = config
        self.step_timeout_s = step_timeout_s
        self._broken: str | None = None
        self._in_flight: deque[int] = deque()  # step ids submitted and not yet collected, oldest first
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(config.tensor_parallel_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main, args=(rank, config, init_method, child_end), name=f"shardserve-tp{rank}", daemon=True
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        try:
            blocks = self._gather("startup", startup_timeout_s)
            self.num_kv_blocks: int = min(blocks)  # block ids must be valid on every rank
            self._broadcast(("allocate", self.num_kv_blocks))
            self._gather("allocate", startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Sends the plan to every rank and returns; the ranks run plans in the order they arrive."""
        self._broadcast(("step", plan))
        self._in_flight.append(plan.step_id)

    def collect(self) -> StepResult:
        """Every rank's reply to the oldest submitted step (pipes keep order); rank 0's result."""
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        step_id = self._in_flight.popleft()
        replies = self._gather(f"step {step_id}", self.step_timeout_s)
        if replies[0].step_id != step_id:
            self._fail(f"rank 0 answered step {replies[0].step_id}, expected {step_id}")
        for rank, reply in enumerate(replies[1:], start=1):
            if reply != step_id:
                self._fail(f"rank {rank} acknowledged step {reply}, expected {step_id}")
        return replies[0]

    def _broadcast(self, message: tuple) -> None:
        if self._broken:
            raise WorkerError(f"the executor failed earlier: {self._broken}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(message)
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"rank {rank} is gone ({exc!r})")

    def _gather(self, what: str, timeout_s: float) -> list[Any]:
        """Every rank's reply; the first error, death or the deadline raises WorkerError."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self._conns):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(self._conns))) - set(replies))
                self._fail(f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s")
            pending = {conn: rank for rank, conn in enumerate(self._conns) if rank not in replies}
            sentinels = {self._procs[rank].sentinel: rank for rank in pending.values()}
            for ready in wait(list(pending) + list(sentinels), timeout=left):
                if ready in pending:
                    rank = pending[ready]
                    try:
                        kind, payload = ready.recv()
                    except (EOFError, OSError):
                        self._fail(f"{what}: rank {rank} closed its pipe (exit code {self._procs[rank].exitcode})")
                    if kind == "error":
                        self._fail(f"{what}: rank {rank} raised:\n{payload}")
                    replies[rank] = payload
                elif not _has_data(self._conns[sentinels[ready]]):
                    rank = sentinels[ready]
                    self._procs[rank].join(timeout=1.0)
                    self._fail(f"{what}: rank {rank} died (exit code {self._procs[rank].exitcode})")
        return [replies[rank] for rank in range(len(self._conns))]

    def _fail(self, message: str) -> None:
        self._broken = message
        self.shutdown(timeout_s=1.0)  # a healthy peer may be stuck in a collective with the failed rank
        raise WorkerError(message)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Asks every rank to leave, then terminates, then kills what is still alive after the timeout."""
        for conn in self._conns:
            try:
                conn.send(("shutdown", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._broken is None:
            self._broken = "shut down"


def _has_data(conn: Connection) -> bool:
    """A rank may have written its traceback just before exiting: read that before calling it a silent death."""
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False
