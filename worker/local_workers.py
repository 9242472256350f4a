"""Local tensor parallelism: one spawned process per rank on this machine, each serving the Worker gRPC service
(worker/worker_service.py) on 127.0.0.1 with an ephemeral port, the same service a Ray actor hosts, checking a
secret made here and handed to the rank through its spawn arguments (another local process cannot drive it).

start_local_workers() returns their endpoints and a torch.distributed rendezvous on loopback; the caller drives
them with the controller's GrpcExecutor (shardserve/api/local_executors.py: create_executor wires the two). Each rank reports its
address over a pipe; a rank that raises or dies before it serves is reported with its traceback or exit code,
within a deadline. The pipe stays open afterwards: a rank whose parent is gone (the pipe closed) stops serving.
The ranks are spawned without the parent's __main__ (_script_not_rerun): they need nothing of it, and a script that
calls LLM(tensor_parallel_size=N) without the `if __name__ == "__main__":` guard must not run again in each rank.
On CUDA each rank picks its own device from its rank (ModelRunner); on CPU the ranks share the host's cores.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading
import types
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from shardserve.proto.auth import new_secret
from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import world_size
from shardserve.proto.transport import free_port


@dataclass
class LocalWorkers:
    endpoints: list[str]  # "127.0.0.1:port" of each rank's Worker server, rank order
    init_method: str  # torch.distributed rendezvous on loopback
    processes: list[Any]  # multiprocessing.Process, rank order
    secret: str = field(default="", repr=False)  # the worker-plane secret these ranks check (proto/auth.py)
    _pipes: list[Connection] = field(default_factory=list)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Closes the pipes (a rank stops serving when its pipe closes), waits up to timeout_s for the ranks to
        exit, then terminates what is still alive (a rank stuck in a collective), then kills. Idempotent."""
        for pipe in self._pipes:
            pipe.close()
        self._pipes = []
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)


def start_local_workers(config: EngineConfig, startup_timeout_s: float = 120.0, group: int = 0,
                        groups: int = 1) -> LocalWorkers:
    """Starts tensor_parallel_size x pipeline_parallel_size worker processes (spawned, daemonic; rank order as
    proto/stages.py lays them out) and waits for their addresses.
    They serve but are not initialised: GrpcExecutor runs Init, LoadWeights, ProfileMemory and AllocateKVCache.
    Raises RuntimeError when a rank fails or does not report in time (every started rank is stopped then).
    group of groups: one of several TP groups on this host (LLM's data parallelism): on CUDA its ranks see only
    GPUs group * tp ... group * tp + tp - 1 (of those this process sees); on CPU the groups share the cores."""
    ctx = mp.get_context("spawn")
    tp = world_size(config)  # every rank of the group: its pipeline stages' TP ranks
    visible = _visible_gpus(group * tp, tp) if config.device == "cuda" and groups > 1 else None
    workers = LocalWorkers([], f"tcp://127.0.0.1:{free_port()}", [], new_secret())
    try:
        for rank in range(tp):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_serve_rank, args=(config.device, tp * groups, child_end, workers.secret, visible),
                               name=f"shardserve-tp{rank}", daemon=True)
            with _script_not_rerun(), _omp_threads(config.device, tp * groups):
                proc.start()
            child_end.close()
            workers.processes.append(proc)
            workers._pipes.append(parent_end)
        workers.endpoints = _addresses(workers, startup_timeout_s)
    except BaseException:
        workers.stop(timeout_s=0.0)
        raise
    return workers


@contextlib.contextmanager
def _script_not_rerun():
    """While a rank is spawned: an empty __main__ in its place. multiprocessing's spawn re-runs the parent's main script
    (or module) in each child, so that the child can unpickle what the script defines; a rank's target and arguments
    are the engine's own, so nothing of the script is needed, and a script without the __main__ guard would start
    LLM again inside each rank (where multiprocessing refuses to spawn, and the rank dies)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextlib.contextmanager
def _omp_threads(device: str, ranks_on_host: int):
    """While a rank is spawned: OMP_NUM_THREADS as its share of the cores, so that the native kernels' OpenMP
    threads (the runtime reads it when it loads, before the rank sets torch's) divide the cores as torch's do."""
    if device == "cuda" or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    from shardserve.worker.distributed import cpu_threads_per_rank

    os.environ["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(device, ranks_on_host))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _addresses(workers: LocalWorkers, timeout_s: float) -> list[str]:
    """Every rank's reported address; the first error, death or the deadline raises RuntimeError."""
    replies: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(replies) < len(workers.processes):
        pending = {pipe: rank for rank, pipe in enumerate(workers._pipes) if rank not in replies}
        if time.monotonic() >= deadline:
            raise RuntimeError(f"local ranks {sorted(pending.values())} did not start within {timeout_s:.0f} s")
        sentinels = {workers.processes[rank].sentinel: rank for rank in pending.values()}
        for ready in wait([*pending, *sentinels], timeout=max(0.0, deadline - time.monotonic())):
            rank = pending.get(ready, sentinels.get(ready))
            if rank in replies:
                continue
            try:  # a rank may have written its traceback just before exiting: read that first
                kind, payload = workers._pipes[rank].recv()
            except (EOFError, OSError):
                workers.processes[rank].join(timeout=1.0)
                raise RuntimeError(f"local rank {rank} died before serving "
                                   f"(exit code {workers.processes[rank].exitcode})") from None
            if kind == "error":
                raise RuntimeError(f"local rank {rank} failed to start:\n{payload}")
            replies[rank] = payload
    return [replies[rank] for rank in range(len(workers.processes))]


def _visible_gpus(first: int, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for GPUs first .. first + count - 1 of those this process sees."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in seen.split(",")] if seen else [str(i) for i in range(first + count)]
    if len(ids) < first + count:
        raise ValueError(f"GPUs {first}..{first + count - 1} asked for; this process sees {len(ids)}")
    return ",".join(ids[first:first + count])


def _serve_rank(device: str, ranks_on_host: int, conn: Connection, secret: str, visible: str | None = None) -> None:
    """One rank's process: serve the Worker service until Shutdown stops it or the parent goes away."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before CUDA starts: this rank's group's GPUs only
    try:
        from shardserve.worker.distributed import cpu_threads_per_rank, prepare_worker_process
        from shardserve.worker.worker_service import serve_worker

        prepare_worker_process(cpu_threads_per_rank(device, ranks_on_host))
        server, address = serve_worker("127.0.0.1", 0, secret=secret)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", address))
    threading.Thread(target=_stop_when_orphaned, args=(conn, server), name="parent-watch", daemon=True).start()
    server.wait_for_termination()


def _stop_when_orphaned(conn: Connection, server: Any) -> None:
    try:
        conn.recv()  # nothing is ever sent: this returns when the parent closes its end or dies
    except (EOFError, OSError):
        pass
    server.stop(grace=None)
