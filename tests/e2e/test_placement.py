"""Placement on a simulated 3-node Ray cluster: STRICT_PACK keeps a TP group on one node (STRICT_SPREAD, the
control, does not), a group no node can hold fails with a clear PlacementError instead of hanging, and replicas
fill the nodes one TP group each.

The multi-raylet cluster runs in a subprocess (one cluster for every test here: starting one costs ~15 s on 2
cores): this pytest process may already be connected to the session Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_placement_cluster.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster_report(tiny_llama_dir) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(REPO), RAY_ADDRESS="")
    proc = subprocess.run([sys.executable, str(SCRIPT), tiny_llama_dir], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(REPO))
    assert proc.returncode == 0, f"placement script failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def groups(cluster_report) -> dict:
    return cluster_report["groups"]


def test_simulated_cluster_has_three_nodes(cluster_report):
    assert len(cluster_report["nodes"]) == 3


def test_strict_pack_keeps_a_tp_group_on_one_node(groups):
    packed = groups["packed"]
    assert len(packed["bundle_nodes"]) == 1
    assert len(set(packed["rank_nodes"])) == 1 and packed["rank_nodes"][0] in packed["bundle_nodes"]


def test_strict_spread_control_puts_the_ranks_on_two_nodes(groups):
    assert len(set(groups["spread"]["rank_nodes"])) == 2  # proves the check above can tell the difference


def test_a_group_no_node_can_hold_fails_with_a_placement_error(groups):
    assert groups["too_large"].startswith("could not place 5 bundles"), groups["too_large"]
    assert "STRICT_PACK" in groups["too_large"]


def test_replicas_auto_fills_the_three_nodes_each_group_on_one_node(cluster_report):
    replicas = cluster_report["replicas"]
    assert len(cluster_report["nodes"]) == 3 and len(replicas) == 3
    assert all(len(r["nodes"]) == 2 and len(set(r["nodes"])) == 1 for r in replicas)  # STRICT_PACK: one node
    assert sorted(r["nodes"][0] for r in replicas) == cluster_report["nodes"]  # one replica per node


def test_each_replica_host_runs_on_its_tp_groups_node(cluster_report):
    hosts, name = cluster_report["hosts"], cluster_report["name"]
    assert len(hosts) == 3
    for r in cluster_report["replicas"]:
        assert hosts[f"{name}-host{r['id'].rsplit('/', 1)[1]}"] == r["nodes"][0]


def test_every_replica_serves_and_names_itself(cluster_report):
    ids = sorted(r["id"] for r in cluster_report["replicas"])
    assert sorted(set(cluster_report["answered_by"])) == ids  # round-robin: all three answered


def test_spread_placement_lets_a_tp_group_span_nodes(cluster_report):
    (spread,) = cluster_report["spread"]
    assert len(set(spread["nodes"])) == 2
