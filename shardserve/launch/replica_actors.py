"""Replica hosts on Ray: each replica's Engine and EngineLoop in a Ray actor of its own (cluster/replica_host.py),
started by the controller (ControllerConfig.replica_hosts), so that two replicas' host work runs on two cores
instead of sharing the controller's GIL.

    hosts = RayReplicaHosts(name="shardserve-1a2b", device="cuda")   # picklable: travels inside ControllerConfig
    handle = hosts.start("shardserve-1a2b/0", config, build_engine, 5.0, 3, 1.0)
    hosts.kill(handle)

`serve` uses them when it runs more than one replica (`--replica-hosts auto`); `process` forces them for one
replica too and `controller` keeps every engine in the controller process (the A/B baseline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

REPLICA_HOST_MODES = ("auto", "process", "controller")
# Hosts and fronts are detached named actors in this namespace: they outlive the controller that started them (its
# death breaks no stream), and a restarted controller finds them by name.
NAMESPACE = "shardserve"


def use_replica_hosts(mode: str, num_replicas: int) -> bool:
    if mode not in REPLICA_HOST_MODES:
        raise ValueError(f"--replica-hosts must be one of {', '.join(REPLICA_HOST_MODES)}, got {mode!r}")
    return mode == "process" or (mode == "auto" and num_replicas > 1)


@dataclass
class RayReplicaHosts:
    """Starts and ends replica host actors. A host reserves a CPU on CUDA clusters (its engine thread is the GPU's
    feeder); on CPU clusters it reserves none, leaving the cores to the CPU ranks (which need them more). Its
    placement group (below) is its own: a host that dies leaves it, kill() removes it."""

    name: str  # the cluster's name: host i is "{name}-host{i}"
    device: str = "cuda"

    _placement: dict = field(default_factory=dict, repr=False)  # host actor id -> its placement group

    def start(self, replica_id: str, config, build_engine, health_check_interval_s: float, restart_tries: int,
              restart_backoff_s: float):
        """The host actor, beside its TP group: with a RayGroupFactory, one placement group holds the group's rank
        bundles (bundle 0 with the host's CPU too) and the host runs in bundle 0; every group it starts (restarts
        included) goes into that placement group's bundles. Blocks until the placement group is placed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from shardserve.cluster.replica_host import ReplicaHost
        from shardserve.launch.placement import place_group

        index = replica_id.rsplit("/", 1)[-1]
        cpus = 1 if self.device == "cuda" else 0
        options = dict(name=f"{self.name}-host{index}", namespace=NAMESPACE, lifetime="detached", num_cpus=cpus,
                       max_restarts=0, max_concurrency=1000)
        pg = None
        if _takes_placement_group(build_engine):  # shardserve/launch/ray_serving.py's RayGroupFactory
            pg = place_group(config, build_engine.strategy, f"{self.name}-host{index}-pg", extra_cpus=cpus,
                             detached=True)
            build_engine = dataclasses.replace(build_engine, placement_group=pg)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0)
        handle = ray.remote(ReplicaHost).options(**options).remote(
            replica_id, config, build_engine, health_check_interval_s, restart_tries, restart_backoff_s)
        self._placement[handle._actor_id.hex()] = pg
        return handle

    def find(self, replica_id: str):
        """The live host actor of this replica (started by this or an earlier controller), or None."""
        import ray

        try:
            return ray.get_actor(self._host_name(replica_id), namespace=NAMESPACE)
        except ValueError:
            return None

    @staticmethod
    def same(a, b) -> bool:
        return a._actor_id == b._actor_id

    def _host_name(self, replica_id: str) -> str:
        return f"{self.name}-host{replica_id.rsplit('/', 1)[-1]}"

    def kill(self, handle, replica_id: str | None = None) -> None:
        """Ends the host process (its TP group's actors die with it), then removes its placement group (found by
        name when an earlier controller placed it)."""
        import ray
        from ray.util.placement_group import get_placement_group, remove_placement_group

        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
        pg = self._placement.pop(handle._actor_id.hex(), None)
        if pg is None and replica_id is not None:
            try:
                pg = get_placement_group(f"{self._host_name(replica_id)}-pg")
            except Exception:
                pg = None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:
                pass


def _takes_placement_group(build_engine) -> bool:
    return dataclasses.is_dataclass(build_engine) and any(f.name == "placement_group"
                                                          for f in dataclasses.fields(build_engine))
