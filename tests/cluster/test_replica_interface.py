"""Both kinds of replica implement the one Replica interface (cluster/replica.py) that the front, the router and
the controller's views use, so none of them needs to know where an engine runs."""

from __future__ import annotations

import pytest

from shardserve.cluster.local_replica import LocalReplica
from shardserve.cluster.remote_replica import RemoteReplica
from shardserve.cluster.replica import Replica, ReplicaState
from shardserve.proto.config import EngineConfig


@pytest.mark.parametrize("kind", [LocalReplica, RemoteReplica])
def test_both_replica_kinds_implement_the_replica_interface(kind):
    replica = kind("r/0", EngineConfig(model="m", device="cpu"), lambda cfg: None, lambda r, s: None,
                   lambda r, e: None)
    assert isinstance(replica, Replica)
    names = set(Replica.__annotations__) | {n for n in vars(Replica) if not n.startswith("_")}
    assert {"admit", "abort", "submit", "load", "tokenizer"} <= names
    assert [n for n in sorted(names) if not hasattr(replica, n)] == []
    assert replica.state is ReplicaState.STOPPED and not replica.serving and not replica.recovering
    replica.state = ReplicaState.SERVING
    assert replica.serving and not replica.recovering
