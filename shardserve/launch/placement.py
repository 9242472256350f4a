"""Ray placement of a replica's worker group: one placement group per group, one WorkerActor per rank.

Ray decides where the ranks run and hands back their gRPC endpoints; from then on the controller talks to the
workers over gRPC only (cluster/executor.py). STRICT_PACK (the default) keeps a TP group on one node, where
its all-reduces run over NVLink/shared memory instead of the network.

With pipeline stages (pipeline_parallel_size > 1) the group's bundles are one per stage, each holding that stage's
TP ranks (a bundle is always on one node: STRICT_PACK per stage), and the group's strategy spreads the stages:
PACK by default (stages share a node where it has room, else go to others), STRICT_SPREAD with --placement spread
or STRICT_SPREAD (every stage on a node of its own); `stage_strategy` maps the TP group's strategy to these.

    ensure_ray("local")                       # or "auto" to join `ray start --head ...`
    group = launch_worker_group(config)
    executor = GrpcExecutor(config, group.endpoints, group.init_method)
    ...
    executor.shutdown(); group.shutdown()
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardserve.proto.config import EngineConfig
from shardserve.proto.stages import world_size
from shardserve.worker.actor import WorkerActor

# A CPU rank's bundle is half a logical CPU, so that TP=3 places even on a 2-core Ray started with defaults.
CPU_RANK_BUNDLE = {"CPU": 0.5}
GPU_RANK_BUNDLE = {"GPU": 1, "CPU": 1}


class PlacementError(RuntimeError):
    """The TP group's placement group could not be placed in time (too few resources on any one node)."""


def _off_the_event_loop(what: str) -> None:
    """Placing and starting a group blocks on Ray (ray.get) for seconds: on an event loop's thread that would stall
    every stream the loop serves. The controller calls these in asyncio.to_thread; anything else is a bug.

    Ray warns of any ray.get in an asyncio actor (the controller), whichever thread it runs on: the thread checked
    here, that warning is turned off for this process, where it would only mislead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        return
    raise RuntimeError(f"{what} blocks on Ray: call it off the event loop (asyncio.to_thread)")


def ensure_ray(address: str = "local") -> None:
    """Connects this process to Ray (nothing if it already is).

    "local": starts a Ray on this machine, loopback only, with at least 8 logical CPUs (TP ranks on a 2-core
    machine place). "auto": joins the cluster `ray start` runs on this node. Anything else: a cluster address.
    """
    import ray

    if ray.is_initialized():
        return
    if address == "local":
        # Without this, Ray binds the machine's external address; the local cluster stays on 127.0.0.1.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        from shardserve.launch.local_ray import init_local_ray

        init_local_ray(max(8, os.cpu_count() or 1))
    else:
        ray.init(address=address, logging_level="warning")


@dataclass
class WorkerGroup:
    """One TP group's workers: their endpoints in rank order and the Ray handles that keep them alive."""

    endpoints: list[str]  # "host:port" of each rank's Worker server, rank order
    init_method: str  # torch.distributed rendezvous on rank 0's node, "tcp://ip:port"
    placement_group: Any  # ray.util.placement_group.PlacementGroup
    actors: list[Any]  # Ray actor handles, rank order
    node_ids: list[str] = field(default_factory=list)  # Ray node of each rank
    secret: str = field(default="", repr=False)  # this launch's worker-plane secret (proto/auth.py)
    tls: Any = None  # proto.auth.WorkerTLS: the worker plane's mutual TLS, or None
    owns_placement_group: bool = True  # False: a replica host's, kept for the next group (launch_worker_group)
    node_ips: list[str] = field(default_factory=list)  # the address of each rank's node (the ready line's stages)
    _shut_down: bool = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Shutdown RPC to every worker (bounded), then kill the actors and remove the placement group.
        Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._shut_down:
            return
        self._shut_down = True
        _shutdown_workers(self.endpoints, timeout_s, self.secret, self.tls)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        if self.owns_placement_group:
            remove_placement_group(self.placement_group)


STAGE_STRATEGIES = {"STRICT_PACK": "PACK", "PACK": "PACK", "SPREAD": "STRICT_SPREAD", "STRICT_SPREAD": "STRICT_SPREAD"}


def stage_strategy(strategy: str) -> str:
    """The strategy across a pipelined group's stage bundles for the TP group strategy the user chose."""
    return STAGE_STRATEGIES[strategy]


def bundle_of(config: EngineConfig, rank: int) -> int:
    """The bundle a rank's actor takes: its own, or with pipeline stages its stage's."""
    return rank // config.tensor_parallel_size if config.pipeline_parallel_size > 1 else rank


def place_group(config: EngineConfig, strategy: str = "STRICT_PACK", name: str = "shardserve-pg",
                extra_cpus: float = 0.0, timeout_s: float = 60.0, detached: bool = False):
    """A placement group with one bundle per rank, or per pipeline stage with that stage's ranks' resources (bundle
    0 with extra_cpus more: a replica host's), ready. detached: it outlives its creator (a replica host's, which
    outlives the controller). Raises PlacementError when it cannot be placed within timeout_s."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    _off_the_event_loop("place_group")
    bundle = GPU_RANK_BUNDLE if config.device == "cuda" else CPU_RANK_BUNDLE
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp > 1:
        bundle = {key: value * tp for key, value in bundle.items()}
        strategy = stage_strategy(strategy)
    bundles = [dict(bundle) for _ in range(pp if pp > 1 else tp)]
    bundles[0]["CPU"] += extra_cpus
    pg = placement_group(bundles, strategy=strategy, name=name, lifetime="detached" if detached else None)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"could not place {len(bundles)} bundles of {bundle} with {strategy} within "
            f"{timeout_s:.0f} s (cluster resources: {ray.cluster_resources()}, available: "
            f"{ray.available_resources()}); STRICT_PACK needs one node with all of them"
        ) from None
    return pg


def cpu_ranks_on_node(config: EngineConfig, num_replicas: int, num_nodes: int) -> int | None:
    """The CPU ranks one node holds when num_replicas groups spread evenly over num_nodes (None on CUDA): what
    each rank's threads are divided by."""
    if config.device == "cuda":
        return None
    return -(-num_replicas * world_size(config) // max(1, num_nodes))


def launch_worker_group(
    config: EngineConfig,
    worker_host: str = "127.0.0.1",
    strategy: str = "STRICT_PACK",
    name_prefix: str | None = None,
    placement_timeout_s: float = 60.0,
    startup_timeout_s: float = 120.0,
    placement_group=None,
    tls=None,
    ranks_on_node: int | None = None,
) -> WorkerGroup:
    """Places one WorkerActor per rank (pipeline stages x TP ranks) in one placement group and starts their gRPC
    servers.

    The workers are serving but not initialised: GrpcExecutor(config, group.endpoints, group.init_method) runs
    Init, LoadWeights, ProfileMemory and AllocateKVCache. Raises PlacementError when the group cannot be placed
    within placement_timeout_s. Call ensure_ray() first. placement_group: one placed already (place_group: a replica
    host's, bundle i for rank i), used and left in place by the group's shutdown; None: a new one, removed by it. tls (proto.auth.WorkerTLS): the worker
    plane over mutual TLS (the workers read the files on their nodes).
    """
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from shardserve.proto.auth import new_secret
    from shardserve.worker.distributed import MULTICAST_OFF_ENV, cpu_threads_per_rank  # imports torch: lazily

    _off_the_event_loop("launch_worker_group")
    tp = world_size(config)  # every rank of the replica
    prefix = name_prefix or f"shardserve-{uuid.uuid4().hex[:8]}"
    bundle = GPU_RANK_BUNDLE if config.device == "cuda" else CPU_RANK_BUNDLE
    owned = placement_group is None
    pg = place_group(config, strategy, f"{prefix}-pg", timeout_s=placement_timeout_s) if owned else placement_group

    # CPU ranks share their node's cores with every other rank placed there (other replicas' too): torch's threads
    # and the native kernels' OpenMP threads (OMP_NUM_THREADS, read when the runtime loads) from that count.
    num_threads = cpu_threads_per_rank(config.device, max(tp, ranks_on_node or 0))
    env = dict(MULTICAST_OFF_ENV, **({"OMP_NUM_THREADS": str(num_threads)} if num_threads else {}))
    remote_cls = ray.remote(WorkerActor)
    secret = new_secret()  # only this launch's executor can drive these workers
    actors = []
    try:
        for rank in range(tp):
            actors.append(
                remote_cls.options(
                    name=f"{prefix}-rank{rank}",
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,  # a dead rank breaks its TP group: the controller sees it, Ray must not hide it
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=bundle_of(config, rank)
                    ),
                    runtime_env={"env_vars": env},
                ).remote(worker_host, num_threads, secret=secret, tls=tls)
            )
        endpoints = ray.get([a.endpoint.remote() for a in actors], timeout=startup_timeout_s)
        node_ids = ray.get([a.node_id.remote() for a in actors], timeout=startup_timeout_s)
        node_ips = ray.get([a.node_ip.remote() for a in actors], timeout=startup_timeout_s)
        rendezvous_ip, rendezvous_port = ray.get(
            [actors[0].node_ip.remote(), actors[0].free_port.remote()], timeout=startup_timeout_s
        )
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if owned:
            remove_placement_group(pg)
        raise
    if worker_host.startswith("127.") or worker_host == "localhost":
        rendezvous_ip = worker_host  # a loopback-only deployment keeps the rendezvous on loopback too
    init_method = f"tcp://{rendezvous_ip}:{rendezvous_port}"
    return WorkerGroup(endpoints, init_method, pg, actors, node_ids, secret, tls, owns_placement_group=owned,
                       node_ips=node_ips)


def _shutdown_workers(endpoints: list[str], timeout_s: float, secret: str, tls=None) -> None:
    """Sends Shutdown to every worker at once and waits up to timeout_s; unreachable workers are skipped."""
    import grpc

    from shardserve.proto import worker_pb2 as pb
    from shardserve.proto import worker_pb2_grpc as pb_grpc
    from shardserve.proto.transport import worker_channel

    channels = [worker_channel(ep, secret, tls) for ep in endpoints]
    try:
        calls = [pb_grpc.WorkerStub(ch).Shutdown.future(pb.ShutdownRequest(), timeout=timeout_s) for ch in channels]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError:
                pass  # already stopped or dead: the actor is killed next anyway
    finally:
        for ch in channels:
            ch.close()
