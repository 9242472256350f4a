"""Run by test_placement.py in a process of its own: a simulated 3-node Ray cluster (three raylets on loopback,
1 CPU each: room for exactly one TP=2 group of 0.5-CPU ranks per node).

argv: the tiny model's folder. Prints one JSON line with
- the nodes;
- worker groups launched alone (no model needed): a TP=2 group under STRICT_PACK and, the control, under
  STRICT_SPREAD (each rank's node and each bundle's node), and the error of a group no node can hold;
- replicas: each replica's rank nodes (--replicas auto, which on CPU is one per node: 3; STRICT_PACK) and each
  replica host's node, the replica every answer named, and a TP=2 group started with --placement spread's strategy.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, before Ray is imported

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from shardserve.client.clients import Client  # noqa: E402
from shardserve.settings.resolve import build_engine_config  # noqa: E402
from shardserve.launch.placement import PlacementError, launch_worker_group  # noqa: E402
from shardserve.proto.config import EngineConfig  # noqa: E402
from shardserve.launch.ray_serving import start_cluster  # noqa: E402


def _describe(group) -> dict:
    table = ray.util.placement_group_table(group.placement_group)
    return {"rank_nodes": group.node_ids, "bundle_nodes": sorted(set(table["bundles_to_node_id"].values()))}


def groups() -> dict:
    """Worker groups launched without an engine: where STRICT_PACK and STRICT_SPREAD put them, and a group too
    large for any node."""
    report = {}
    config = EngineConfig(model="unused", tensor_parallel_size=2)  # launching needs no model: no Init here
    packed = launch_worker_group(config, strategy="STRICT_PACK", name_prefix="packed")
    spread = launch_worker_group(config, strategy="STRICT_SPREAD", name_prefix="spread")  # the control
    report["packed"], report["spread"] = _describe(packed), _describe(spread)
    packed.shutdown()
    spread.shutdown()
    try:  # 5 ranks x 0.5 CPU: no single 1-CPU node holds them
        launch_worker_group(EngineConfig(model="unused", tensor_parallel_size=5), placement_timeout_s=3.0)
        report["too_large"] = "placed"
    except PlacementError as exc:
        report["too_large"] = str(exc)
    return report


def replicas(model_dir: str) -> dict:
    """Served replicas: where --replicas auto and --placement spread put them, and who answered."""
    report: dict = {}
    config = build_engine_config(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                                 num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=64)
    running = start_cluster(config, host="127.0.0.1", port=0, replicas="auto", routing="round-robin")
    try:
        with Client(running.address, timeout=120) as client:
            report["answered_by"] = [client.generate([5 + i, 6, 7], max_tokens=2).replica for i in range(6)]
        report["replicas"] = ray.get(running.controller.replica_stats.remote())
        report["hosts"] = {a["Name"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                           if (a["Name"] or "").startswith(f"{running.name}-host") and a["State"] == "ALIVE"}
        report["name"] = running.name
    finally:
        running.shutdown(drain_timeout_s=0)
    running = start_cluster(config, host="127.0.0.1", port=0, replicas=1, strategy="SPREAD")
    try:
        report["spread"] = ray.get(running.controller.replica_stats.remote())
    finally:
        running.shutdown(drain_timeout_s=0)
    return report


def main(model_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    report: dict = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
    try:
        report["groups"] = groups()
        report |= replicas(model_dir)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
