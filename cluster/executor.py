"""The Executor interface the Engine drives, its one error type, and GrpcExecutor: the controller's Executor
over gRPC, one long-lived bidirectional Step stream per TP rank.

GrpcExecutor drives every worker that is not in the caller's process: Ray actors (shardserve/launch/placement.py) and
local TP processes (worker/local_workers.py) run the same Worker service (worker/worker_service.py).

Startup (the order worker.proto gives): Init on every rank at once (they rendezvous together, so one at a time
would deadlock), LoadWeights, ProfileMemory -> num_kv_blocks = the minimum (block ids must be valid on every
rank), AllocateKVCache(minimum), then one Step stream per rank. The first rank to fail a call fails the start.

Per step: the plan is encoded once and written to every rank's stream; every rank answers with its step id (rank 0
with the sampled tokens). submit() and collect() are separate, so the controller may plan step N+1 while step N
runs; execute() is submit + collect. The hot path creates no channel and no thread: each stream has one
long-lived reader thread that moves replies into one queue, where collect() waits with a deadline that follows the
measured step times (cluster/step_deadline.py). Any rank's error, a closed stream (a dead process or Ray actor)
or the deadline (a stopped or wedged rank) raises WorkerError, and the executor is unusable afterwards (the TP
group's collectives cannot recover from a lost rank: the surviving ranks may be blocked in one for good, so the
group is torn down and started again by its owner, cluster/engine_loop.py says how the engine resumes).

cluster/ never imports worker/: only grpc and shardserve.proto.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from shardserve.cluster.step_deadline import StepDeadline
from shardserve.proto import worker_pb2 as pb
from shardserve.proto import worker_pb2_grpc as pb_grpc
from shardserve.proto.config import EngineConfig
from shardserve.proto.convert import engine_config_to_proto, step_plan_to_proto, step_result_from_proto
from shardserve.proto.plan import StepPlan, StepResult
from shardserve.proto.stages import result_rank, world_size
from shardserve.proto.transport import worker_channel

_CLOSE = object()  # ends a request stream


class Executor(Protocol):
    """Runs step plans on the model: in-process (worker/inprocess.py) or over gRPC (GrpcExecutor) to local
    processes or Ray actors. Plans run in submission order on every rank (worker/step_loop.py says why)."""

    num_kv_blocks: int  # the cache size the workers allocated: the block manager's capacity

    def execute(self, plan: StepPlan) -> StepResult: ...  # submit + collect

    def submit(self, plan: StepPlan) -> None: ...  # queues a plan; returns without waiting for it

    def collect(self) -> StepResult: ...  # the oldest submitted plan's result (waits for that one only)

    def shutdown(self) -> None: ...


class WorkerError(RuntimeError):
    """A rank refused or failed a call, died, or did not answer in time; the executor is unusable afterwards."""


@dataclass(frozen=True)
class RankHealth:
    rank: int
    state: str  # worker.proto's WorkerState without its prefix ("READY", "FAILED", ...) or "UNREACHABLE"
    last_step_id: int
    error: str

    @property
    def ready(self) -> bool:
        return self.state == "READY"


class _StepStream:
    """One rank's Step stream: a request queue gRPC reads from, and a reader thread feeding the shared replies."""

    def __init__(self, rank: int, stub: pb_grpc.WorkerStub, replies: queue.SimpleQueue) -> None:
        self.rank = rank
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Step(iter(self.requests.get, _CLOSE))
        self.reader = threading.Thread(target=self._read, args=(replies,), name=f"step-reader-{rank}", daemon=True)
        self.reader.start()

    def _read(self, replies: queue.SimpleQueue) -> None:
        try:
            for msg in self.call:
                replies.put((self.rank, msg))
            replies.put((self.rank, WorkerError(f"rank {self.rank} closed its Step stream")))
        except grpc.RpcError as exc:
            replies.put((self.rank, WorkerError(f"rank {self.rank}'s Step stream failed: {exc.code()}: {exc.details()}")))

    def close(self) -> None:
        self.requests.put(_CLOSE)
        self.call.cancel()


def check_shared_hosts(profiles: list, num_blocks: int) -> None:
    """Raises ValueError when the ranks that share a host would together take more of its memory for their CPU
    caches than it had available (each rank checked only its own share: three ranks of 15 GiB each passed on a
    24 GiB host, whose memory then ran out as the caches filled). profiles: ProfileMemoryResponse per rank."""
    hosts: dict[str, list] = {}
    for rank, profile in enumerate(profiles):
        if profile.host_id and profile.host_available_bytes > 0:
            hosts.setdefault(profile.host_id, []).append((rank, profile))
    for ranks in hosts.values():
        need = sum(p.block_bytes for _, p in ranks) * num_blocks
        available = max(p.host_available_bytes for _, p in ranks)  # read by each rank at about the same time
        if len(ranks) > 1 and need > available:
            gib = 1 << 30
            raise ValueError(
                f"the KV caches of ranks {', '.join(str(r) for r, _ in ranks)}, which share one host, would take "
                f"{need / gib:.2f} GiB together ({num_blocks} blocks each), more than the {available / gib:.2f} GiB "
                "of memory it has available: lower kv_cache_memory_gb (--kv-cache-memory-gb, per rank) or "
                "num_kv_blocks (--num-kv-blocks)")


class GrpcExecutor:
    def __init__(
        self,
        config: EngineConfig,
        endpoints: list[str],
        init_method: str,
        *,
        deadline: StepDeadline | None = None,
        startup_timeout_s: float = 600.0,
        rpc_timeout_s: float = 10.0,
        stop_workers: Callable[[float], None] | None = None,
        secret: str = "",
        tls=None,
    ) -> None:
        """secret: the workers' launch secret (WorkerGroup.secret, LocalWorkers.secret), sent with every call;
        the workers refuse any call without it (UNAUTHENTICATED). tls: proto.auth.WorkerTLS when the workers serve
        over mutual TLS.
        stop_workers(timeout_s): stops workers this executor owns (local processes); called by shutdown, and
        as soon as a step fails (a healthy rank may be stuck in a collective with the failed one). A Ray group is
        stopped by its owner instead, and stays up after a failure for health checks to report it."""
        if not secret:
            raise ValueError("GrpcExecutor needs the workers' launch secret (secret=...)")
        if len(endpoints) != world_size(config):
            raise ValueError(f"{len(endpoints)} endpoints for tensor_parallel_size {config.tensor_parallel_size} x "
                             f"pipeline_parallel_size {config.pipeline_parallel_size}")
        self._result_rank = result_rank(config)  # whose answers carry the tokens (the last pipeline stage's first)
        self.config = config
        self.endpoints = list(endpoints)
        self.deadline = deadline if deadline is not None else StepDeadline()
        self.rpc_timeout_s = rpc_timeout_s
        self._stop_workers = stop_workers
        self._broken: str | None = None
        # (step id, submitted at, batched tokens) of the plans submitted and not yet collected, oldest first
        self._in_flight: deque[tuple[int, float, int]] = deque()
        self._last_done = 0.0  # when the last collected step's last answer arrived
        self._early: list[deque] = [deque() for _ in endpoints]  # replies to later steps that arrived first
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: list[_StepStream] = []
        self._channels = [worker_channel(ep, secret, tls) for ep in self.endpoints]
        self._stubs = [pb_grpc.WorkerStub(ch) for ch in self._channels]
        self.last_forward_ms = 0.0  # the slowest rank's forward_ms in the last collected step
        self.forward_ms_total = 0.0  # ... summed over every collected step (a control-plane share's numerator)
        self.forward_ms_by_rank = [0.0] * len(endpoints)  # each rank's own, summed (a pipeline stage's busy time)
        try:
            self._start(init_method, startup_timeout_s)
        except BaseException:
            self.shutdown(timeout_s=2.0)
            raise

    def _start(self, init_method: str, timeout_s: float) -> None:
        config_msg = engine_config_to_proto(self.config)
        world = len(self._stubs)
        device = self.config.device
        self._call_all(
            "Init",
            lambda rank: pb.InitRequest(rank=rank, world_size=world, init_method=init_method, device=device, config=config_msg),
            timeout_s=self.config.dist_timeout_s + self.rpc_timeout_s,
        )
        self._call_all("LoadWeights", lambda rank: pb.LoadWeightsRequest(), timeout_s)
        profiles = self._call_all("ProfileMemory", lambda rank: pb.ProfileMemoryRequest(), timeout_s)
        self.num_kv_blocks: int = min(p.num_blocks for p in profiles)
        check_shared_hosts(profiles, self.num_kv_blocks)
        self._call_all("AllocateKVCache", lambda rank: pb.AllocateKVCacheRequest(num_blocks=self.num_kv_blocks), timeout_s)
        self._streams = [_StepStream(rank, stub, self._replies) for rank, stub in enumerate(self._stubs)]

    def _call_all(self, method: str, request_for_rank, timeout_s: float) -> list:
        """The same unary call on every rank at once (gRPC futures: no threads); raises on the first failure to
        come back, not on rank order (a rank waiting in a rendezvous for a dead peer would hold it up)."""
        calls = [getattr(stub, method).future(request_for_rank(rank), timeout=timeout_s) for rank, stub in enumerate(self._stubs)]
        done: queue.SimpleQueue = queue.SimpleQueue()
        for rank, call in enumerate(calls):
            call.add_done_callback(lambda _, rank=rank: done.put(rank))
        for _ in calls:
            rank = done.get()
            try:
                calls[rank].result()
            except grpc.RpcError as exc:
                for other in calls:
                    other.cancel()
                raise WorkerError(f"{method} on rank {rank} ({self.endpoints[rank]}) failed: {exc.code()}: {exc.details()}") from None
        return [call.result() for call in calls]

    # ---- steps ---------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Sends the plan to every rank; returns at once. Plans must be submitted in step-id order."""
        if self._broken is not None:
            raise WorkerError(f"the executor failed earlier: {self._broken}")
        msg = step_plan_to_proto(plan)  # encoded once, shared by every stream
        for stream in self._streams:
            stream.requests.put(msg)
        self._in_flight.append((plan.step_id, time.monotonic(), plan.num_batched_tokens))

    def collect(self) -> StepResult:
        """Waits for every rank's reply to the oldest submitted step; returns the result rank's (rank 0's, or the
        last pipeline stage's first rank's)."""
        if self._broken is not None:
            raise WorkerError(f"the executor failed earlier: {self._broken}")
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        step_id, submitted_at, num_tokens = self._in_flight[0]
        started = max(submitted_at, self._last_done)  # queued behind the previous step until it was done
        allowed_s = self.deadline.seconds_for(num_tokens)
        deadline = started + allowed_s
        while any(not early for early in self._early):
            try:
                rank, reply = self._replies.get(timeout=max(deadline - time.monotonic(), 1e-3))
            except queue.Empty:
                missing = [r for r, early in enumerate(self._early) if not early]
                self._fail(f"step {step_id}: ranks {missing} did not answer within {allowed_s:.1f} s (the step "
                           "deadline, from recent step times): stopped or hung")
            if isinstance(reply, Exception):
                self._fail(f"step {step_id}: {reply}")
            if reply.error:  # the worker's error names its rank and the step (worker/step_loop.py)
                self._fail(reply.error)
            self._early[rank].append(reply)
        self._in_flight.popleft()
        self._last_done = time.monotonic()
        self.deadline.observe(self._last_done - started, num_tokens)
        replies = [early.popleft() for early in self._early]
        for rank, reply in enumerate(replies):
            if reply.step_id != step_id:
                self._fail(f"rank {rank} acknowledged step {reply.step_id}, expected {step_id}")
        by_rank = self.forward_ms_by_rank
        for rank, reply in enumerate(replies):
            by_rank[rank] += reply.forward_ms
        self.last_forward_ms = max(r.forward_ms for r in replies)
        self.forward_ms_total += self.last_forward_ms
        return step_result_from_proto(replies[self._result_rank])

    def _fail(self, message: str) -> None:
        self._broken = message
        if self._stop_workers is not None:
            self.shutdown(timeout_s=1.0)
        raise WorkerError(message)

    # ---- health and shutdown -------------------------------------------------------------------------------
    def health(self) -> list[RankHealth]:
        """Every rank's state (asked at once); a rank that does not answer in rpc_timeout_s is UNREACHABLE."""
        calls = [stub.Health.future(pb.HealthRequest(), timeout=self.rpc_timeout_s) for stub in self._stubs]
        states = []
        for rank, call in enumerate(calls):
            try:
                h = call.result()
                name = pb.WorkerState.Name(h.state).removeprefix("WORKER_STATE_")
                states.append(RankHealth(rank, name, h.last_step_id, h.error))
            except grpc.RpcError as exc:
                states.append(RankHealth(rank, "UNREACHABLE", 0, f"{exc.code()}: {exc.details()}"))
        return states

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Closes the streams, asks every rank to shut down (bounded), closes the channels, stops the workers it
        owns. Idempotent."""
        if not self._channels:
            return
        for stream in self._streams:
            stream.close()
        calls = [stub.Shutdown.future(pb.ShutdownRequest(), timeout=timeout_s) for stub in self._stubs]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError:
                pass  # a rank already gone has nothing to shut down
        for ch in self._channels:
            ch.close()
        self._channels, self._stubs, self._streams = [], [], []
        if self._broken is None:
            self._broken = "shut down"
        if self._stop_workers is not None:
            self._stop_workers(timeout_s)
