"""Ray orchestration of `shardserve serve`: the controller actor, its TP worker groups, a clean drain on SIGTERM.

    cluster = start_cluster(config, host="127.0.0.1", port=50051)   # after ensure_ray(...)
    ...                                                              # clients talk to cluster.address
    cluster.shutdown(drain_timeout_s=30)                             # no actor, placement group or process left

The controller actor runs on the node where `serve` was started (hard node affinity), so --host binds an address
of this machine. It starts each replica's TP group itself (RayGroupFactory, called once per replica start): a
placement group (STRICT_PACK: all ranks on one node) and one worker actor per rank, owned by the controller actor,
so they die with it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardserve.cluster.executor import GrpcExecutor
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.config import model_facts
from shardserve.proto.config import EngineConfig
from shardserve.replica_hosts import RayReplicaHosts, use_replica_hosts


@dataclass
class GrpcExecutorFactory:
    """Builds a GrpcExecutor over workers someone else started (bench/harness.py); picklable."""

    endpoints: list[str]
    init_method: str
    secret: str = field(default="", repr=False)  # the workers' launch secret: reaches the controller through Ray

    def __call__(self, config: EngineConfig):
        from shardserve.cluster.executor import GrpcExecutor

        return GrpcExecutor(config, self.endpoints, self.init_method, secret=self.secret)


class GroupExecutor(GrpcExecutor):
    """A GrpcExecutor over a Ray worker group it owns: its shutdown also stops the group."""

    def __init__(self, config: EngineConfig, group, deadline: StepDeadline | None = None) -> None:
        self.group = group  # shardserve.launcher.WorkerGroup
        super().__init__(config, group.endpoints, group.init_method, secret=group.secret, tls=group.tls,
                         deadline=deadline)

    @property
    def node_ids(self) -> list[str]:
        """The Ray node of each rank (Controller.replica_stats reports them)."""
        return self.group.node_ids

    def shutdown(self, timeout_s: float = 10.0) -> None:
        try:
            super().shutdown(timeout_s)
        finally:
            self.group.shutdown(timeout_s)


@dataclass
class RayGroupFactory:
    """One replica's start, run inside the controller actor (ControllerConfig.build_engine; Ray pickles it): places
    the TP group's placement group and worker actors (shardserve/launcher.py), then builds the Engine over them
    (engine_factory.build_engine). Every call starts a fresh group, named "{name}-g<random>"; the engine's shutdown
    stops the group again."""

    name: str
    worker_host: str = "127.0.0.1"
    strategy: str = "STRICT_PACK"
    step_deadline: StepDeadline | None = None  # the settings; each group measures its own step times
    tls: Any = None  # proto.auth.WorkerTLS: the worker plane over mutual TLS, or None
    placement_group: Any = None  # a replica host's (shardserve/replica_hosts.py): every group of it goes there

    def __call__(self, config: EngineConfig):
        from shardserve.engine_factory import build_engine
        from shardserve.launcher import launch_worker_group

        group = launch_worker_group(config, self.worker_host, self.strategy,
                                    name_prefix=f"{self.name}-g{uuid.uuid4().hex[:6]}", tls=self.tls,
                                    placement_group=self.placement_group)
        try:
            deadline = self.step_deadline.fresh() if self.step_deadline is not None else None
            return build_engine(config, lambda c: GroupExecutor(c, group, deadline))
        except BaseException:
            group.shutdown()
            raise


@dataclass
class RunningCluster:
    """The serving controller actor (it owns the replicas' worker groups)."""

    address: str  # the Generation server, host:port
    metrics_address: str | None
    controller: Any  # the Ray actor handle
    name: str  # every actor and placement group of this cluster is named "{name}-..."
    _stopped: bool = False

    def status(self, timeout_s: float = 10.0) -> dict:
        import ray

        return ray.get(self.controller.status.remote(), timeout=timeout_s)

    def worker_groups(self, timeout_s: float = 30.0) -> list:
        """Each replica's current launcher.WorkerGroup (endpoints, actors, secret), in replica order."""
        import ray

        return ray.get(self.controller.worker_groups.remote(), timeout=timeout_s)

    def shutdown(self, drain_timeout_s: float = 30.0) -> int:
        """Drains (requests still running after drain_timeout_s end with UNAVAILABLE), stops the workers, kills
        the actors and removes the placement group. Returns how many requests the drain cut off. Idempotent."""
        import ray

        if self._stopped:
            return 0
        self._stopped = True
        cut = 0
        try:
            cut = ray.get(self.controller.shutdown.remote(drain_timeout_s), timeout=drain_timeout_s + 60)
        except Exception as e:  # a dead controller: its workers die with it (Ray: the actors it owns)
            print(f"shardserve: controller shutdown failed: {e!r}", file=sys.stderr)
        finally:
            try:
                ray.kill(self.controller, no_restart=True)
            except Exception:
                pass
        return cut


def _model_name(config: EngineConfig, requested: str | None) -> str:
    """--served-model-name, else the model's name without its server path (shardserve/models.py: display_name)."""
    from shardserve.models import display_name

    return requested or display_name(config.model.rstrip("/"))


def served_model(config: EngineConfig, name: str):
    """What GetModelInfo reports (cluster/controller.py ServedModel), from the facts the engine factory reads."""
    from shardserve.cluster.controller import ServedModel

    facts = model_facts(config)
    return ServedModel(name, facts.architecture, facts.vocab_size, facts.eos_token_ids, facts.bos_token_id)


def check_cluster_gpus(config: EngineConfig) -> None:
    """--device cuda needs a GPU per rank in the Ray cluster: told in one line as soon as Ray is up, instead of
    a placement group that waits for GPUs that will never come."""
    import ray

    if config.device != "cuda":
        return
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < config.tensor_parallel_size:
        raise ValueError(
            f"--device cuda with --tp {config.tensor_parallel_size} needs {config.tensor_parallel_size} GPU(s) in the "
            f"Ray cluster; it has {have} (start Ray on GPU nodes, or pass --device cpu)"
        )


def start_cluster(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 50051,
    worker_host: str = "127.0.0.1",
    metrics_port: int | None = None,
    strategy: str = "STRICT_PACK",
    model_name: str | None = None,
    ready_timeout_s: float = 600.0,
    max_live_requests: int = 4096,
    replicas: int | str = 1,
    routing: str = "cache-aware",
    security=None,
    step_deadline: StepDeadline | None = None,
    stream_interval: int = 1,
    worker_tls=None,
    replica_hosts: str = "auto",
) -> RunningCluster:
    """Launches the controller, which starts the replicas' worker groups (Ray must be connected:
    shardserve.launcher.ensure_ray), and returns once health is SERVING. Everything started is torn down again if
    any of it fails. security: the client API's token, TLS and size limit (cluster/api_security.py ApiSecurity;
    None = none, the default limit). worker_tls: proto.auth.WorkerTLS, the worker plane over mutual TLS."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from shardserve.cluster.controller import Controller, ControllerConfig

    name = f"shardserve-{uuid.uuid4().hex[:8]}"
    served = served_model(config, _model_name(config, model_name))
    num_replicas = auto_replicas(config) if replicas == "auto" else int(replicas)
    hosts = RayReplicaHosts(name, config.device) if use_replica_hosts(replica_hosts, num_replicas) else None
    controller = None
    try:
        controller_config = ControllerConfig(
            engine=config,
            model=served,
            build_engine=RayGroupFactory(name, worker_host, strategy, step_deadline, worker_tls),
            host=host,
            port=port,
            metrics_port=metrics_port,
            name=name,
            max_live_requests=max_live_requests,
            num_replicas=num_replicas,
            routing=routing,
            stream_interval=stream_interval,
            replica_hosts=hosts,
        )
        if security is not None:
            controller_config.security = security
        here = ray.get_runtime_context().get_node_id()
        controller = (
            ray.remote(Controller)
            .options(
                name=f"{name}-controller",
                num_cpus=0,  # it mostly waits on the workers; it must not take a CPU a rank needs
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            )
            .remote(controller_config)
        )
        address = ray.get(controller.start.remote(), timeout=120)
        if not ray.get(controller.wait_ready.remote(ready_timeout_s), timeout=ready_timeout_s + 30):
            raise TimeoutError(f"the workers did not load within {ready_timeout_s:g} s")
        status = ray.get(controller.status.remote(), timeout=30)
    except BaseException:
        if controller is not None:
            try:
                ray.get(controller.shutdown.remote(0.0), timeout=30)
            except Exception:
                pass
            ray.kill(controller, no_restart=True)
        raise
    return RunningCluster(address, status["metrics_address"], controller, name)


def auto_replicas(config: EngineConfig) -> int:
    """--replicas auto: as many TP groups as the cluster's GPUs hold (CUDA), or one per alive node (CPU)."""
    import ray

    if config.device == "cuda":
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < config.tensor_parallel_size:
            raise ValueError(f"--replicas auto: the cluster has {gpus} GPU(s), fewer than --tp "
                             f"{config.tensor_parallel_size}")
        return gpus // config.tensor_parallel_size
    return max(1, sum(1 for node in ray.nodes() if node["Alive"]))


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
          http_host: str | None = None, http_workers: int = 1, replicas: int | str = 1,
          routing: str = "cache-aware", security=None, step_deadline: StepDeadline | None = None,
          stream_interval: int = 1, worker_tls=None, replica_hosts: str = "auto") -> int:
    """Runs until SIGTERM/SIGINT (then drains and exits 0) or until the engine fails for good (exits 1): a controller
    actor that died, or whose groups could not be restarted, is started again (with fresh groups) on the same
    address, up to CONTROLLER_RESTARTS times. http_port: also the HTTP gateway (shardserve/gateway.py), started
    once the server is ready, stopped after the drain."""
    import ray

    from shardserve.launcher import ensure_ray

    address = resolve_ray_address(ray_address)
    if address == "local" and (host.startswith("127.") or host == "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback server: Ray on loopback too
    started_ray = not ray.is_initialized()
    ray_host = None
    if address == "local" and started_ray:  # Ray in a session of its own: a signal to our group leaves it up
        from shardserve.local_ray import LocalRay

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
    try:
        start = time.perf_counter()
        check_cluster_gpus(config)
        cluster = start_cluster(config, host=host, port=port, worker_host=worker_host, metrics_port=metrics_port,
                                strategy=strategy, model_name=model_name, max_live_requests=max_live_requests,
                                replicas=replicas, routing=routing, security=security,
                                step_deadline=step_deadline, stream_interval=stream_interval,
                                worker_tls=worker_tls, replica_hosts=replica_hosts)
        for s in previous:
            signal.signal(s, drain_on_signal)
        metrics = f", metrics on http://{cluster.metrics_address}/metrics" if cluster.metrics_address else ""
        replicas_now = len(cluster.status()["replicas"])
        print(f"shardserve ready: {_model_name(config, model_name)} (tp={config.tensor_parallel_size}, "
              f"replicas={replicas_now}, {config.device}) serving on {cluster.address}{metrics} [{time.perf_counter() - start:.1f} s]",
              flush=True)
        if http_port is not None:
            from shardserve.gateway import GatewayThread

            gateway = GatewayThread(cluster.address, http_host or host, http_port, workers=http_workers)
            print(f"shardserve gateway ready: http://{gateway.address}/v1", flush=True)
        restarts = 0
        while not stop.wait(1.0):
            try:
                status = cluster.status()
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not dead: asked again in a second
            except Exception as e:  # the controller actor died (its worker groups died with it)
                status = {"state": "failed", "error": repr(e)}
            if status["state"] != "failed":
                continue
            if restarts == CONTROLLER_RESTARTS or stop.is_set():
                print(f"shardserve: the engine failed: {status['error']}", file=sys.stderr, flush=True)
                code = 1
                break
            restarts += 1  # a fresh controller and groups on the same address; resuming clients go on there
            print(f"shardserve: the engine failed ({status['error']}): starting it again "
                  f"({restarts}/{CONTROLLER_RESTARTS})", file=sys.stderr, flush=True)
            cluster.shutdown(drain_timeout_s=0.0)
            bound_port = int(cluster.address.rsplit(":", 1)[1])
            try:
                cluster = start_cluster(config, host=host, port=bound_port, worker_host=worker_host,
                                        metrics_port=metrics_port, strategy=strategy, model_name=model_name,
                                        max_live_requests=max_live_requests, replicas=replicas, routing=routing,
                                        security=security, step_deadline=step_deadline,
                                        stream_interval=stream_interval, worker_tls=worker_tls,
                                        replica_hosts=replica_hosts)
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
            ray.shutdown()
        if ray_host is not None:
            ray_host.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code
