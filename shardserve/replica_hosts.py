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

from dataclasses import dataclass

REPLICA_HOST_MODES = ("auto", "process", "controller")


def use_replica_hosts(mode: str, num_replicas: int) -> bool:
    if mode not in REPLICA_HOST_MODES:
        raise ValueError(f"--replica-hosts must be one of {', '.join(REPLICA_HOST_MODES)}, got {mode!r}")
    return mode == "process" or (mode == "auto" and num_replicas > 1)


@dataclass
class RayReplicaHosts:
    """Starts and ends replica host actors. A host reserves a CPU on CUDA clusters (its engine thread is the GPU's
    feeder); on CPU clusters it reserves none, leaving the cores to the CPU ranks (which need them more)."""

    name: str  # the cluster's name: host i is "{name}-host{i}"
    device: str = "cuda"

    def start(self, replica_id: str, config, build_engine, health_check_interval_s: float, restart_tries: int,
              restart_backoff_s: float):
        import ray

        from shardserve.cluster.replica_host import ReplicaHost

        index = replica_id.rsplit("/", 1)[-1]
        return (
            ray.remote(ReplicaHost)
            .options(name=f"{self.name}-host{index}", num_cpus=1 if self.device == "cuda" else 0, max_restarts=0,
                     max_concurrency=1000)
            .remote(replica_id, config, build_engine, health_check_interval_s, restart_tries, restart_backoff_s)
        )

    def kill(self, handle) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
