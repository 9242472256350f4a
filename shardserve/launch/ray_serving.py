"""Ray orchestration of `shardserve serve` (shardserve/launch/server_process.py): the controller actor, its TP worker groups.

    cluster = start_cluster(config, host="127.0.0.1", port=50051)   # after ensure_ray(...)
    ...                                                              # clients talk to cluster.address
    cluster.shutdown(drain_timeout_s=30)                             # no actor, placement group or process left

The controller actor runs on the node where `serve` was started (hard node affinity), so --host binds an address
of this machine. It starts each replica's TP group itself (RayGroupFactory, called once per replica start): a
placement group (STRICT_PACK: all ranks on one node) and one worker actor per rank, owned by the controller actor,
so they die with it.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardserve.cluster.executor import GrpcExecutor
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.settings.resolve import model_facts
from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import world_size
from shardserve.launch.front_actors import RayFronts, sweep
from shardserve.launch.replica_actors import RayReplicaHosts, use_replica_hosts


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
        self.group = group  # shardserve.launch.placement.WorkerGroup
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
    the TP group's placement group and worker actors (shardserve/launch/placement.py), then builds the Engine over them
    (engine_factory.build_engine). Every call starts a fresh group, named "{name}-g<random>"; the engine's shutdown
    stops the group again."""

    name: str
    worker_host: str = "127.0.0.1"
    strategy: str = "STRICT_PACK"
    step_deadline: StepDeadline | None = None  # the settings; each group measures its own step times
    tls: Any = None  # proto.auth.WorkerTLS: the worker plane over mutual TLS, or None
    placement_group: Any = None  # a replica host's (shardserve/launch/replica_actors.py): every group of it goes there
    ranks_on_node: int | None = None  # CPU ranks of every replica on a node: its cores are divided among them

    def __call__(self, config: EngineConfig):
        from shardserve.settings.engine_factory import build_engine
        from shardserve.launch.placement import launch_worker_group

        group = launch_worker_group(config, self.worker_host, self.strategy,
                                    name_prefix=f"{self.name}-g{uuid.uuid4().hex[:6]}", tls=self.tls,
                                    placement_group=self.placement_group, ranks_on_node=self.ranks_on_node)
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
        except Exception as e:  # a dead controller: its fronts and hosts are ended below
            print(f"shardserve: controller shutdown failed: {e!r}", file=sys.stderr)
        finally:
            try:
                ray.kill(self.controller, no_restart=True)
            except Exception:
                pass
            sweep(self.name)  # whatever a dead controller left: fronts, hosts (and their groups), placement groups
        return cut


def model_name_of(config: EngineConfig, requested: str | None) -> str:
    """--served-model-name, else the model's name without its server path (shardserve/settings/model_source.py: display_name)."""
    from shardserve.settings.model_source import display_name

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
    need = world_size(config)
    if have < need:
        raise ValueError(
            f"--device cuda with --tp {config.tensor_parallel_size} x --pp {config.pipeline_parallel_size} needs "
            f"{need} GPU(s) in the Ray cluster; it has {have} (start Ray on GPU nodes, or pass --device cpu)"
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
    fronts: int = 1,
    name: str | None = None,
) -> RunningCluster:
    """Launches the controller, which starts the replicas' worker groups (Ray must be connected:
    shardserve.launch.placement.ensure_ray), and returns once health is SERVING. Everything started is torn down again if
    any of it fails. security: the client API's token, TLS and size limit (cluster/api_security.py ApiSecurity;
    None = none, the default limit). worker_tls: proto.auth.WorkerTLS, the worker plane over mutual TLS. fronts:
    front processes on the client API's port (with replica hosts). name: a running cluster's (a new controller adopts
    its live hosts and fronts instead of starting new ones: its controller died)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from shardserve.cluster.controller import Controller, ControllerConfig
    from shardserve.launch.placement import cpu_ranks_on_node

    if name is not None:
        _end_dead_controller(f"{name}-controller")
    name = name or f"shardserve-{uuid.uuid4().hex[:8]}"
    served = served_model(config, model_name_of(config, model_name))
    num_replicas = auto_replicas(config) if replicas == "auto" else int(replicas)
    hosts = RayReplicaHosts(name, config.device) if use_replica_hosts(replica_hosts, num_replicas) else None
    if fronts < 1:
        raise ValueError(f"--fronts must be at least 1, got {fronts}")
    here = ray.get_runtime_context().get_node_id()
    controller = None
    try:
        controller_config = ControllerConfig(
            engine=config,
            model=served,
            build_engine=RayGroupFactory(name, worker_host, strategy, step_deadline, worker_tls,
                                         ranks_on_node=cpu_ranks_on_node(config, num_replicas, _alive_nodes())),
            host=host,
            port=port,
            metrics_port=metrics_port,
            name=name,
            max_live_requests=max_live_requests,
            num_replicas=num_replicas,
            routing=routing,
            stream_interval=stream_interval,
            replica_hosts=hosts,
            fronts=RayFronts(name, here, fronts) if hosts is not None else None,
        )
        if security is not None:
            controller_config.security = security
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
        try:
            ready = ray.get(controller.wait_ready.remote(ready_timeout_s), timeout=ready_timeout_s + 30)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):  # refused settings: the message, not the actor's traceback
                raise ValueError(str(e.cause)) from None
            raise
        if not ready:
            raise TimeoutError(f"the workers did not load within {ready_timeout_s:g} s")
        status = ray.get(controller.status.remote(), timeout=30)
    except BaseException:
        if controller is not None:
            try:
                ray.get(controller.shutdown.remote(0.0), timeout=30)
            except Exception:
                pass
            ray.kill(controller, no_restart=True)
        sweep(name)
        raise
    return RunningCluster(address, status["metrics_address"], controller, name)


def _end_dead_controller(actor_name: str, timeout_s: float = 30.0) -> None:
    """A cluster's earlier controller (dead, or dying) is ended and its name freed for the new one."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            old = ray.get_actor(actor_name)
        except ValueError:
            return
        try:
            ray.kill(old, no_restart=True)
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the earlier controller {actor_name} did not go away within {timeout_s:g} s")


def _alive_nodes() -> int:
    import ray

    return max(1, sum(1 for node in ray.nodes() if node["Alive"]))


def auto_replicas(config: EngineConfig) -> int:
    """--replicas auto: as many TP groups as the cluster's GPUs hold (CUDA), or one per alive node (CPU)."""
    import ray

    if config.device == "cuda":
        gpus, need = int(ray.cluster_resources().get("GPU", 0)), world_size(config)
        if gpus < need:
            raise ValueError(f"--replicas auto: the cluster has {gpus} GPU(s), fewer than a replica's {need} "
                             f"(--tp x --pp)")
        return gpus // need
    return max(1, sum(1 for node in ray.nodes() if node["Alive"]))
