"""CPU ranks that share a node share its cores: each rank's torch threads and the native kernels' OpenMP threads
(OMP_NUM_THREADS, read when the runtime loads) come from every rank placed on that node, other replicas' included."""

from __future__ import annotations

import os

from shardserve.launch.placement import cpu_ranks_on_node
from shardserve.proto.config import EngineConfig
from shardserve.worker.distributed import cpu_threads_per_rank
from shardserve.worker.local_workers import _omp_threads


def test_ranks_on_a_node_count_every_replica_placed_there():
    cpu = EngineConfig(model="m", device="cpu", tensor_parallel_size=1)
    assert cpu_ranks_on_node(cpu, num_replicas=2, num_nodes=1) == 2  # two replicas on one node share it
    assert cpu_ranks_on_node(cpu, num_replicas=2, num_nodes=2) == 1
    assert cpu_ranks_on_node(EngineConfig(model="m", device="cpu", tensor_parallel_size=3), 2, 1) == 6
    assert cpu_ranks_on_node(EngineConfig(model="m", device="cuda"), 2, 1) is None
    cores = os.cpu_count() or 1
    assert cpu_threads_per_rank("cpu", cpu_ranks_on_node(cpu, 2, 1)) == max(1, cores // 2)


def test_a_spawned_rank_gets_its_share_of_the_cores_as_omp_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with _omp_threads("cpu", 2):
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert "OMP_NUM_THREADS" not in os.environ
    with _omp_threads("cuda", 2):
        assert "OMP_NUM_THREADS" not in os.environ
