"""The Worker gRPC service: one tensor-parallel rank behind a socket (worker.proto's service Worker).

Lifecycle, driven by the controller (cluster/grpc_executor.py): Init (join the TP process group) -> LoadWeights
(build the ModelRunner, which loads this rank's slice) -> ProfileMemory -> AllocateKVCache -> one long-lived Step
stream -> Shutdown. The state machine is worker.proto's WorkerState; Health reports it with the last step id, so a
rank that failed or fell behind is visible to the controller.

Step ids: a plan is applied only when its id is exactly the last completed id + 1. Any other plan is answered with
an error and not applied; the worker stays READY (the refusal protects it, nothing in it broke). An exception
inside a step is different: this rank's state may be half-updated and its peers may be stuck in a collective, so
the worker turns FAILED, reports the traceback and refuses every later plan. Never a silent death.

Only worker.proto's messages cross the socket: plans are decoded with proto/convert.py, never unpickled.
torch and the model code are imported lazily, so a process that only serves (a fresh Ray actor) starts fast.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import traceback
from concurrent import futures
from typing import Any

import grpc

from shardserve.proto import worker_pb2 as pb
from shardserve.proto import worker_pb2_grpc as pb_grpc
from shardserve.proto.config import EngineConfig
from shardserve.proto.convert import engine_config_from_proto, step_plan_from_proto, step_result_to_proto

# Large plans (a batch of long prompts) and results (logprobs) exceed gRPC's 4 MiB default.
GRPC_MESSAGE_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, on_shutdown: Any = None) -> None:
        self._on_shutdown = on_shutdown  # called once by Shutdown (stops the server)
        self._lock = threading.Lock()  # one lifecycle call or step at a time
        self.state = pb.WORKER_STATE_STARTED
        self.error = ""
        self.rank = 0
        self.world_size = 1
        self.config: EngineConfig | None = None
        self.runner: Any = None  # worker.model_runner.ModelRunner after LoadWeights
        self.last_step_id = 0

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_STARTED, "Init")
            try:
                from shardserve.worker.distributed import init_distributed

                self.config = engine_config_from_proto(request.config)
                self.rank, self.world_size = request.rank, request.world_size
                backend = "nccl" if self.config.device == "cuda" else "gloo"
                init_distributed(self.rank, self.world_size, request.init_method, backend, self.config.dist_timeout_s)
                self.state = pb.WORKER_STATE_INITIALIZED
            except Exception:
                self._fail_call(context, "Init")
            return pb.InitResponse(pid=os.getpid(), hostname=socket.gethostname(), device_name=_device_name(self.config))

    def LoadWeights(self, request: pb.LoadWeightsRequest, context: grpc.ServicerContext) -> pb.LoadWeightsResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_INITIALIZED, "LoadWeights")
            try:
                import time

                from shardserve.worker.model_runner import ModelRunner

                started = time.perf_counter()
                self.runner = ModelRunner(self.config, self.rank)  # its constructor loads this rank's weights
                load_s = time.perf_counter() - started
                weight_bytes = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
                self.state = pb.WORKER_STATE_LOADED
            except Exception:
                self._fail_call(context, "LoadWeights")
            return pb.LoadWeightsResponse(weight_bytes=weight_bytes, load_s=load_s)

    def ProfileMemory(self, request: pb.ProfileMemoryRequest, context: grpc.ServicerContext) -> pb.ProfileMemoryResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_LOADED, "ProfileMemory")
            try:
                from shardserve.worker.kv_cache import bytes_per_block

                runner = self.runner
                num_blocks = runner.profile_num_blocks()
                block_bytes = bytes_per_block(runner.model, runner.block_size, runner.dtype)
            except Exception:
                self._fail_call(context, "ProfileMemory")
            return pb.ProfileMemoryResponse(num_blocks=num_blocks, block_bytes=block_bytes)

    def AllocateKVCache(
        self, request: pb.AllocateKVCacheRequest, context: grpc.ServicerContext
    ) -> pb.AllocateKVCacheResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_LOADED, "AllocateKVCache")
            if request.num_blocks < 1:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_blocks must be >= 1, got {request.num_blocks}")
            try:
                self.runner.allocate_kv_cache(request.num_blocks)
                kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.runner.kv_caches)
                self.state = pb.WORKER_STATE_READY
            except Exception:
                self._fail_call(context, "AllocateKVCache")
            return pb.AllocateKVCacheResponse(num_blocks=request.num_blocks, kv_cache_bytes=kv_bytes)

    # ---- the step stream -----------------------------------------------------------------------------------
    def Step(self, request_iterator, context: grpc.ServicerContext):
        """One StepResult per StepPlan, in order. Refusals and failures travel in StepResult.error.

        Launch-ahead: a reader thread queues incoming plans. After launching plan N the loop waits for plan N+1
        only while N's device work is still running; if it arrives, N+1 is launched behind N before N's tokens
        are read back, so the GPU goes from step N to N+1 without waiting for this process (the engine sends
        N+1 before it collects N: async scheduling). If N finishes first, N's result goes out at once."""
        plans: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_plans, args=(request_iterator, plans), name="step-plans", daemon=True)
        reader.start()
        held: tuple[pb.StepPlan, Any] | None = None  # a launched step whose result is not sent yet
        while True:
            if held is None:
                msg = plans.get()
            else:
                msg = _next_plan_while_running(plans, held[1])
                if msg is None or msg is _END:
                    yield self._finish_step(*held)
                    held = None
                    if msg is None:
                        continue
            if msg is _END:
                break
            launched = self._launch_step(msg)
            if isinstance(launched, pb.StepResult):  # refused: answered in order, after the held step
                if held is not None:
                    yield self._finish_step(*held)
                    held = None
                yield launched
                continue
            if held is not None:
                yield self._finish_step(*held)
            held = (msg, launched)

    def _launch_step(self, msg: pb.StepPlan) -> Any:
        """Applies and queues a plan on the device (StepInFlight), or returns the refusal (a StepResult)."""
        with self._lock:
            if self.state != pb.WORKER_STATE_READY:
                return self._refuse_not_ready(msg)
            if msg.step_id != self.last_step_id + 1:
                return self._refuse(
                    msg,
                    f"rank {self.rank} refuses step {msg.step_id}: expected step {self.last_step_id + 1} "
                    f"(stale or out of order); the plan was not applied",
                )
            try:
                flight = self.runner.launch_step(step_plan_from_proto(msg))
            except Exception:
                return self._fail_step(msg)
            self.last_step_id = msg.step_id
            return flight

    def _finish_step(self, msg: pb.StepPlan, flight: Any) -> pb.StepResult:
        with self._lock:
            if self.state != pb.WORKER_STATE_READY:  # e.g. an earlier step failed after this one was launched
                return self._refuse_not_ready(msg)
            try:
                result = self.runner.finish_step(flight)
            except Exception:
                return self._fail_step(msg)
        if self.rank == 0:
            return step_result_to_proto(result, rank=0)
        # Every rank sampled the same tokens (worker/sampler.py): the others only acknowledge the step id.
        return pb.StepResult(step_id=msg.step_id, rank=self.rank, forward_ms=result.forward_ms)

    def _fail_step(self, msg: pb.StepPlan) -> pb.StepResult:
        """Called from an except block: this rank turns FAILED and refuses every later plan."""
        self.state = pb.WORKER_STATE_FAILED
        self.error = f"rank {self.rank} failed in step {msg.step_id}:\n{traceback.format_exc()}"
        return self._refuse(msg, self.error)

    def _refuse_not_ready(self, msg: pb.StepPlan) -> pb.StepResult:
        why = f"failed earlier: {self.error}" if self.state == pb.WORKER_STATE_FAILED else "not ready"
        return self._refuse(msg, f"rank {self.rank} refuses step {msg.step_id}: the worker is {why}")

    def _refuse(self, msg: pb.StepPlan, error: str) -> pb.StepResult:
        return pb.StepResult(step_id=msg.step_id, rank=self.rank, error=error)

    # ---- health and shutdown -------------------------------------------------------------------------------
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        # No lock: health must answer while a long step runs. Reads of three fields are consistent enough.
        return pb.HealthResponse(state=self.state, last_step_id=self.last_step_id, error=self.error)

    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownResponse:
        # Not under the lock: a rank stuck in a collective holds it, and shutdown must still proceed.
        from shardserve.worker.distributed import destroy_distributed

        destroy_distributed(timeout_s=5.0)  # NCCL's destroy has hung at exit: bounded
        self.runner = None  # frees weights and cache with the last reference
        if self.state != pb.WORKER_STATE_FAILED:
            self.state = pb.WORKER_STATE_STARTED
        if self._on_shutdown is not None:
            on_shutdown, self._on_shutdown = self._on_shutdown, None
            on_shutdown()
        return pb.ShutdownResponse()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _expect(self, context: grpc.ServicerContext, state: int, call: str) -> None:
        if self.state != state:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"rank {self.rank}: {call} needs state {pb.WorkerState.Name(state)}, the worker is "
                f"{pb.WorkerState.Name(self.state)}" + (f" ({self.error})" if self.error else ""),
            )

    def _fail_call(self, context: grpc.ServicerContext, call: str) -> None:
        """Called from an except block: the worker turns FAILED and the call ends with the traceback."""
        self.state = pb.WORKER_STATE_FAILED
        self.error = f"rank {self.rank} failed in {call}:\n{traceback.format_exc()}"
        context.abort(grpc.StatusCode.INTERNAL, self.error)


_END = object()  # the Step stream's requests ended (or the call was cancelled)


def _read_plans(request_iterator, plans: queue.Queue) -> None:
    try:
        for msg in request_iterator:
            plans.put(msg)
    except Exception:  # cancelled or broken stream: the loop ends after what it has
        pass
    finally:
        plans.put(_END)


def _next_plan_while_running(plans: queue.Queue, flight: Any, poll_s: float = 0.0002) -> Any:
    """The next queued plan, waited for only while the launched step still runs on the device; None if it
    finished first (CPU steps are finished at launch: then only a plan already queued is taken)."""
    done = getattr(flight, "done", None)
    while True:
        try:
            return plans.get_nowait() if done is None or done() else plans.get(timeout=poll_s)
        except queue.Empty:
            if done is None or done():
                return None


def _device_name(config: EngineConfig | None) -> str:
    if config is None or config.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def serve_worker(host: str = "127.0.0.1", port: int = 0, max_workers: int = 8) -> tuple[grpc.Server, str]:
    """Starts a Worker server on host:port (0 = an ephemeral port); returns it and its bound "host:port".

    Threads: the Step stream holds one for its whole life; the rest serve Health and the lifecycle calls.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_MESSAGE_OPTIONS)
    # Shutdown stops the server from another thread, after a grace period that lets its own reply leave.
    servicer = WorkerServicer(on_shutdown=lambda: threading.Thread(target=server.stop, args=(1.0,), daemon=True).start())
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise RuntimeError(f"could not bind the worker server to {host}:{port}")
    server.start()
    address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
    return server, address
