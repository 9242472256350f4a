"""Run by test_placement.py in a process of its own: a simulated 2-node Ray cluster (two raylets on loopback).

Prints one JSON line: for each launched group, the Ray node of each rank and of each bundle; and the error of a
group too large for any one node.
"""

from __future__ import annotations

import json
import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, before Ray is imported

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from shardserve.launcher import PlacementError, launch_worker_group  # noqa: E402
from shardserve.proto.config import EngineConfig  # noqa: E402


def _describe(group) -> dict:
    table = ray.util.placement_group_table(group.placement_group)
    return {"rank_nodes": group.node_ids, "bundle_nodes": sorted(set(table["bundles_to_node_id"].values()))}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    report: dict = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
    try:
        config = EngineConfig(model="unused", tensor_parallel_size=2)  # launching needs no model: no Init here
        packed = launch_worker_group(config, strategy="STRICT_PACK", name_prefix="packed")
        spread = launch_worker_group(config, strategy="STRICT_SPREAD", name_prefix="spread")  # the control
        report["packed"], report["spread"] = _describe(packed), _describe(spread)
        packed.shutdown()
        spread.shutdown()
        try:  # 5 ranks x 0.5 CPU: no single 2-CPU node holds them
            launch_worker_group(EngineConfig(model="unused", tensor_parallel_size=5), placement_timeout_s=3.0)
            report["too_large"] = "placed"
        except PlacementError as exc:
            report["too_large"] = str(exc)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
