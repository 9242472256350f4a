"""The Worker gRPC service: one tensor-parallel rank behind a socket (worker.proto's service Worker).

Lifecycle, driven by the controller's GrpcExecutor (cluster/executor.py): Init (join the TP process group) ->
LoadWeights (build the ModelRunner, which loads this rank's slice) -> ProfileMemory -> AllocateKVCache -> one
long-lived Step stream -> Shutdown. The state machine is worker.proto's WorkerState; Health reports it with the
last step id, so a rank that failed or fell behind is visible to the controller.

Step decodes plans, drives the step loop (worker/step_loop.py: step ids, failures, launch-ahead, answer order)
and encodes its answers. The same service runs in a Ray actor (worker/actor.py) and in a local TP process
(worker/local_workers.py). Only worker.proto's messages cross the socket: plans are decoded with
proto/convert.py, never unpickled. torch and the model code are imported lazily, so a process that only serves
(a fresh Ray actor) starts fast.
"""

from __future__ import annotations

import os
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
from shardserve.proto.auth import WORKER_SECRET_KEY, RequireMetadata
from shardserve.proto.transport import MESSAGE_OPTIONS, host_port
from shardserve.worker.step_loop import StepLoop, StepRefusal


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, on_shutdown: Any = None, bind_host: str = "127.0.0.1") -> None:
        self._on_shutdown = on_shutdown  # called once by Shutdown (stops the server)
        self.bind_host = bind_host  # the address this worker was given: its collectives listen there too
        self._lock = threading.Lock()  # one lifecycle call at a time
        self._state = pb.WORKER_STATE_STARTED  # the lifecycle's; FAILED is the step loop's error
        self.rank = 0
        self.world_size = 1
        self.config: EngineConfig | None = None
        self.runner: Any = None  # worker.model_runner.ModelRunner after LoadWeights
        self.steps = StepLoop()  # refuses every plan until AllocateKVCache starts it

    @property
    def state(self) -> int:
        return pb.WORKER_STATE_FAILED if self.steps.error else self._state

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_STARTED, "Init")
            try:
                from shardserve.worker.distributed import init_distributed

                self.config = engine_config_from_proto(request.config)
                self.rank, self.world_size = request.rank, request.world_size
                backend = "nccl" if self.config.device == "cuda" else "gloo"
                init_distributed(self.rank, self.world_size, request.init_method, backend, self.config.dist_timeout_s,
                                 bind_host=self.bind_host, tp=self.config.tensor_parallel_size)
                self._state = pb.WORKER_STATE_INITIALIZED
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
                model = self.runner.model  # (on CPU the linear weights are packed buffers: layers/cpu_packed.py)
                weights = [*model.parameters(), *(b for b in model.buffers() if b.is_mkldnn)]
                weight_bytes = sum(t.numel() * t.element_size() for t in weights)
                self._state = pb.WORKER_STATE_LOADED
            except Exception:
                self._fail_call(context, "LoadWeights")
            return pb.LoadWeightsResponse(weight_bytes=weight_bytes, load_s=load_s)

    def ProfileMemory(self, request: pb.ProfileMemoryRequest, context: grpc.ServicerContext) -> pb.ProfileMemoryResponse:
        with self._lock:
            self._expect(context, pb.WORKER_STATE_LOADED, "ProfileMemory")
            try:
                from shardserve.worker.kv_cache import bytes_per_block, host_memory

                runner = self.runner
                num_blocks = runner.profile_num_blocks()
                block_bytes = bytes_per_block(runner.model, runner.block_size, runner.kv_dtype)
                host_id, available = host_memory(runner.device)
            except Exception:
                self._fail_call(context, "ProfileMemory")
            return pb.ProfileMemoryResponse(num_blocks=num_blocks, block_bytes=block_bytes, host_id=host_id,
                                            host_available_bytes=available)

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
                self._state = pb.WORKER_STATE_READY
                self.steps.start(self.runner, self.rank)
            except Exception:
                self._fail_call(context, "AllocateKVCache")
            return pb.AllocateKVCacheResponse(num_blocks=request.num_blocks, kv_cache_bytes=kv_bytes)

    # ---- the step stream -----------------------------------------------------------------------------------
    def Step(self, request_iterator, context: grpc.ServicerContext):
        """One StepResult per StepPlan, in order (worker/step_loop.py); refusals and failures travel in
        StepResult.error."""
        rank = self.rank
        for answer in self.steps.serve(request_iterator, step_plan_from_proto):
            if isinstance(answer, StepRefusal):
                yield pb.StepResult(step_id=answer.step_id, rank=rank, error=answer.error)
            else:
                yield step_result_to_proto(answer, rank=rank)  # rank > 0: only the step id and forward_ms

    # ---- health and shutdown -------------------------------------------------------------------------------
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        # No lock: health must answer while a long step runs. Reads of three fields are consistent enough.
        return pb.HealthResponse(state=self.state, last_step_id=self.steps.last_step_id, error=self.steps.error)

    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownResponse:
        # Not under the lock: a rank stuck in a collective holds it, and shutdown must still proceed.
        from shardserve.worker.distributed import destroy_distributed

        destroy_distributed(timeout_s=5.0)  # NCCL's destroy has hung at exit: bounded
        self.steps.stop()
        self.runner = None  # frees weights and cache with the last reference
        self._state = pb.WORKER_STATE_STARTED  # a failure stays visible: state reads FAILED while steps.error is set
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
                f"{pb.WorkerState.Name(self.state)}" + (f" ({self.steps.error})" if self.steps.error else ""),
            )

    def _fail_call(self, context: grpc.ServicerContext, call: str) -> None:
        """Called from an except block: the worker turns FAILED and the call ends with the traceback."""
        self.steps.fail(f"rank {self.rank} failed in {call}:\n{traceback.format_exc()}")
        context.abort(grpc.StatusCode.INTERNAL, self.steps.error)


def _device_name(config: EngineConfig | None) -> str:
    if config is None or config.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def serve_worker(host: str = "127.0.0.1", port: int = 0, max_workers: int = 8, *, secret: str,
                 tls=None) -> tuple[grpc.Server, str]:
    """Starts a Worker server on host:port (0 = an ephemeral port); returns it and its bound "host:port".

    secret: the launch's worker-plane secret (proto/auth.py); every call without it in its metadata, Health
    included, ends with UNAUTHENTICATED before the servicer sees it, so only the controller that launched this
    worker can drive it. Threads: the Step stream holds one for its whole life; the rest serve Health and the
    lifecycle calls. tls (proto.auth.WorkerTLS): mutual TLS, only callers with a certificate its CA signed
    complete a handshake.
    """
    if not secret:
        raise ValueError("a worker server needs its launch's secret")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=MESSAGE_OPTIONS,
                         interceptors=[RequireMetadata(WORKER_SECRET_KEY, secret, "the controller's secret", ())])
    # Shutdown stops the server from another thread, after a grace period that lets its own reply leave.
    servicer = WorkerServicer(on_shutdown=lambda: threading.Thread(target=server.stop, args=(1.0,), daemon=True).start(),
                              bind_host=host)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    address = host_port(host, port)
    bound_port = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls.server())
    if bound_port == 0:
        raise RuntimeError(f"could not bind the worker server to {host_port(host, port)}")
    server.start()
    return server, host_port(host, bound_port)
