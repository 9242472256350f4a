"""Run by test_placement.py in a process of its own: replicas on a simulated 3-node Ray cluster (three raylets on
loopback, 1 CPU each: room for exactly one TP=2 group of 0.5-CPU ranks per node).

argv: the tiny model's folder. Prints one JSON line: the nodes, each replica's rank nodes (--replicas auto, which
on CPU is one per node: 3; STRICT_PACK) and each replica host's node,
the replica every answer named, and a TP=2 group started with --placement spread's strategy.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, before Ray is imported

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from shardserve.client import Client  # noqa: E402
from shardserve.config import build_engine_config  # noqa: E402
from shardserve.ray_cluster import start_cluster  # noqa: E402


def main(model_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    report: dict = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
    config = build_engine_config(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                                 num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=64)
    try:
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
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
