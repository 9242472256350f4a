"""Two Ray nodes with addresses of their own: each raylet in a network namespace, joined by a veth pair (root makes
them; the traffic stays inside the machine). A TP=2 group spread over both with `--worker-host node`: each rank's
Worker server listens on its own node's address, the torch.distributed rendezvous runs on rank 0's node address,
the controller reaches both over the veth, and the greedy tokens equal TP=1's. Skips, with the reason, where
namespaces cannot be made (not root, no `ip`, no CAP_NET_ADMIN)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_netns_nodes.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tiny_llama_dir) -> dict:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(SCRIPT), tiny_llama_dir], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(REPO))
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"netns script failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_nodes_have_addresses_of_their_own(report):
    a, b = report["node_addresses"]
    assert a != b and not a.startswith("127.") and not b.startswith("127.")


def test_a_spread_tp_group_serves_from_each_nodes_address_and_rendezvous_on_rank_0s(report):
    hosts = [ep.rsplit(":", 1)[0] for ep in report["endpoints"]]
    assert sorted(hosts) == report["node_addresses"]  # one rank per node, each on its node's address
    assert report["init_method"].startswith(f"tcp://{hosts[0]}:")


def test_tokens_across_the_nodes_equal_one_rank(report):
    assert report["tokens_tp2"] == report["tokens_tp1"] and len(report["tokens_tp1"]) == 8
