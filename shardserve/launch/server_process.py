"""`shardserve serve`: the long-running server process around a Ray cluster (shardserve/launch/ray_serving.py).

It starts the cluster (and the HTTP gateway when asked), then watches it: a controller that failed or died is
started again with fresh groups on the same address, up to CONTROLLER_RESTARTS times; SIGTERM or SIGINT drains the
requests in flight (up to a deadline) and leaves no actor, placement group or process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from shardserve.cluster.step_deadline import StepDeadline
from shardserve.launch.local_ray import LocalRay, shutdown_broken_ray
from shardserve.proto.config import EngineConfig
from shardserve.launch.ray_serving import RunningCluster, check_cluster_gpus, model_name_of, start_cluster

CONTROLLER_RESTARTS = 3  # times `serve` starts a failed or dead controller (and its groups) again, then exits 1


class _Interrupted(BaseException):
    """SIGTERM or SIGINT before the server was ready (a BaseException, so that cleanup handlers see it)."""


def resolve_ray_address(address: str | None) -> str:
    """None: join the cluster this node belongs to when there is one (RAY_ADDRESS or `ray start`), else local."""
    if address:
        return address
    if os.environ.get("RAY_ADDRESS") == "local":
        return "local"
    if os.environ.get("RAY_ADDRESS") or os.path.exists("/tmp/ray/ray_current_cluster"):
        return "auto"
    return "local"


def serve(config: EngineConfig, *, ray_address: str | None, host: str, port: int, worker_host: str,
          metrics_port: int | None, drain_timeout_s: float, strategy: str = "STRICT_PACK",
          model_name: str | None = None, max_live_requests: int = 4096, http_port: int | None = None,
          http_host: str | None = None, http_workers: int = 1, http_limits=None, replicas: int | str = 1,
          routing: str = "cache-aware", security=None, step_deadline: StepDeadline | None = None,
          stream_interval: int = 1, worker_tls=None, replica_hosts: str = "auto", fronts: int = 1) -> int:
    """Runs until SIGTERM/SIGINT (then drains and exits 0) or until the engine fails for good (exits 1): a controller
    actor that died is started again under the cluster's name (it adopts the running replica hosts and fronts: no
    stream breaks, no weights are loaded again); one whose groups could not be restarted is replaced with fresh
    groups on the same address; CONTROLLER_RESTARTS times at most. http_port: also the HTTP gateway (shardserve/gateway/app.py), started
    once the server is ready, stopped after the drain."""
    import ray

    from shardserve.launch.placement import ensure_ray

    address = resolve_ray_address(ray_address)
    if address == "local" and (host.startswith("127.") or host == "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback server: Ray on loopback too
    started_ray = not ray.is_initialized()
    ray_host = None
    if address == "local" and started_ray:  # Ray in a session of its own: a signal to our group leaves it up
        ray_host = LocalRay.start(num_cpus=max(8, os.cpu_count() or 1))
        address = ray_host.address
    ensure_ray(address)
    stop = threading.Event()
    received: list[int] = []

    def interrupt_startup(signum, frame):
        raise _Interrupted(signum)  # start_cluster tears down whatever it had started

    def drain_on_signal(signum, frame):
        received.append(signum)
        stop.set()

    # Installed after ray.init, which sets its own SIGTERM handler (an immediate exit, with no drain).
    previous = {s: signal.signal(s, interrupt_startup) for s in (signal.SIGTERM, signal.SIGINT)}
    cluster = gateway = None
    code = 0
    def start_on(bound_port: int, name: str | None = None) -> RunningCluster:
        return start_cluster(config, host=host, port=bound_port, worker_host=worker_host, metrics_port=metrics_port,
                             strategy=strategy, model_name=model_name, max_live_requests=max_live_requests,
                             replicas=replicas, routing=routing, security=security, step_deadline=step_deadline,
                             stream_interval=stream_interval, worker_tls=worker_tls, replica_hosts=replica_hosts,
                             fronts=fronts, name=name)

    try:
        start = time.perf_counter()
        check_cluster_gpus(config)
        cluster = start_on(port)
        for s in previous:
            signal.signal(s, drain_on_signal)
        metrics = f", metrics on http://{cluster.metrics_address}/metrics" if cluster.metrics_address else ""
        replicas_now = len(cluster.status()["replicas"])
        # the OpenAI API is one flag away: said where a vLLM user looks for its port
        http = "; no OpenAI HTTP API (--http-port 8000 adds it)" if http_port is None else ""
        stages = ""
        if config.pipeline_parallel_size > 1:  # each stage's node
            from shardserve.launch.stage_report import stage_nodes

            stages = (f", pp={config.pipeline_parallel_size}: "
                      f"{stage_nodes(cluster.worker_groups(), config.tensor_parallel_size)}")
        print(f"shardserve ready: {model_name_of(config, model_name)} (tp={config.tensor_parallel_size}, "
              f"replicas={replicas_now}, {config.device}{stages}) serving on {cluster.address}{metrics} "
              f"[{time.perf_counter() - start:.1f} s]{http}", flush=True)
        if http_port is not None:
            from shardserve.gateway.app import GatewayThread

            gateway = GatewayThread(cluster.address, http_host or host, http_port, workers=http_workers,
                                    limits=http_limits)
            print(f"shardserve gateway ready: http://{gateway.address}/v1", flush=True)
        restarts = 0
        while not stop.wait(1.0):
            if ray_host is not None and ray_host.exited:
                # Our local Ray is gone (killed: its GCS, raylet and every actor with it). Nothing is left to drain
                # or to start again on it; said at once, rather than Ray's own abort a minute later.
                print(f"shardserve: the local Ray (pid {ray_host.process.pid}) exited with code "
                      f"{ray_host.process.returncode}: the engine is gone, stopping", file=sys.stderr, flush=True)
                cluster, code = None, 1
                break
            died = False
            try:
                status = cluster.status()
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not dead: asked again in a second
            except Exception as e:  # the controller actor died (hosts and fronts outlive it; in-process replicas not)
                status, died = {"state": "failed", "error": repr(e)}, True
            if status["state"] != "failed":
                continue
            if restarts == CONTROLLER_RESTARTS or stop.is_set():
                print(f"shardserve: the engine failed: {status['error']}", file=sys.stderr, flush=True)
                code = 1
                break
            restarts += 1  # a fresh controller and groups on the same address; resuming clients go on there
            print(f"shardserve: the engine failed ({status['error']}): starting it again "
                  f"({restarts}/{CONTROLLER_RESTARTS})", file=sys.stderr, flush=True)
            bound_port = int(cluster.address.rsplit(":", 1)[1])
            adopt = cluster.name if died else None  # a new controller adopts what still runs
            if not died:
                cluster.shutdown(drain_timeout_s=0.0)
            try:
                cluster = start_on(bound_port, adopt)
            except Exception as e:
                print(f"shardserve: starting the engine again failed: {e!r}", file=sys.stderr, flush=True)
                code = 1
                break
            print(f"shardserve ready again: serving on {cluster.address}", flush=True)
        if received:
            print(f"shardserve: {signal.Signals(received[0]).name}: draining (up to {drain_timeout_s:g} s)",
                  file=sys.stderr, flush=True)
    except _Interrupted as e:
        print(f"shardserve: {signal.Signals(e.args[0]).name} while starting: stopped", file=sys.stderr, flush=True)
    finally:
        for s in previous:  # a second signal must not interrupt the cleanup
            signal.signal(s, drain_on_signal)
        if cluster is not None:
            cut = cluster.shutdown(drain_timeout_s)
            print(f"shardserve: stopped ({cut} request(s) cut off by the drain)", file=sys.stderr, flush=True)
        if gateway is not None:
            gateway.stop()
        if started_ray:
            if ray_host is not None and ray_host.exited:  # Ray is gone with its host
                shutdown_broken_ray()  # what is left: swept with the host's session below
            else:
                ray.shutdown()
        if ray_host is not None:
            ray_host.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code
