"""Local TP: two spawned worker processes over gloo, driven over gRPC, give TP=1's tokens; a rank that raises or
dies surfaces as WorkerError (never a hang) and every rank is ended."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from shardserve.cluster.executor import GrpcExecutor, WorkerError
from shardserve.cluster.step_deadline import StepDeadline
from shardserve.api.local_executors import create_executor
from shardserve.proto.plan import SamplingSpec, StepPlan
from shardserve.worker.inprocess import InProcessExecutor
from shardserve.worker.local_workers import start_local_workers
from test_model_runner import PROMPTS, PlanDriver, assert_same_or_near_tie, engine_config, hf_greedy, save_tiny_llama

NUM_NEW = 8
SAMPLED = SamplingSpec(temperature=1.0, top_p=0.9, seed=2024)


def _requests() -> dict:
    return {
        "g0": (PROMPTS[0], SamplingSpec(temperature=0.0)),
        "g1": (PROMPTS[1], SamplingSpec(temperature=0.0)),
        "s": (PROMPTS[1], SAMPLED),
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"))  # 4 heads, 2 KV heads: TP 2 divides both


@pytest.fixture(scope="module")
def tp2(model_dir):
    executor = create_executor(engine_config(model_dir, tensor_parallel_size=2))
    yield executor
    executor.shutdown()


def test_tp2_matches_tp1_greedy_and_seeded(model_dir, tp2):
    single = InProcessExecutor(engine_config(model_dir))
    tp1 = PlanDriver(single).prefill_and_decode(_requests(), NUM_NEW)
    single.shutdown()
    tp2_out = PlanDriver(tp2).prefill_and_decode(_requests(), NUM_NEW)
    for rid, prompt in (("g0", PROMPTS[0]), ("g1", PROMPTS[1])):
        ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NUM_NEW)
        assert_same_or_near_tie(tp1[rid], ref_tokens, ref_logits)
        assert_same_or_near_tie(tp2_out[rid], ref_tokens, ref_logits)
    assert tp2_out["s"] == tp1["s"]  # same seed, same tokens at any TP size
    assert tp2.num_kv_blocks == 64


def _local_tp2(model_dir, **executor_options):
    """create_executor's wiring, with the processes' handle kept for the test."""
    config = engine_config(model_dir, tensor_parallel_size=2)
    workers = start_local_workers(config)
    return GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop,
                        secret=workers.secret, **executor_options), workers


def test_a_rank_error_in_a_step_surfaces_with_its_traceback(model_dir):
    executor, workers = _local_tp2(model_dir)
    with pytest.raises(WorkerError, match=r"(?s)rank \d raised:.*KeyError.*no state"):
        executor.execute(StepPlan(1, req_ids=["ghost"], num_tokens=[1]))
    with pytest.raises(WorkerError, match="failed earlier"):
        executor.execute(StepPlan(2))
    assert not any(proc.is_alive() for proc in workers.processes)  # every rank was ended


def test_a_rank_that_dies_surfaces_as_worker_error_and_every_rank_is_ended(model_dir):
    executor, workers = _local_tp2(model_dir)
    assert executor.execute(StepPlan(1)).step_id == 1
    workers.processes[1].kill()
    workers.processes[1].join(timeout=30)
    with pytest.raises(WorkerError, match=r"rank 1"):
        executor.execute(StepPlan(2))
    assert not any(proc.is_alive() for proc in workers.processes)
    executor.shutdown()



def _stop(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP, then waits until every thread of pid is stopped: kill() returns before the group stop has reached
    each thread, and a thread still running (gRPC's) could answer the next step."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(stat) as f:
                    text = f.read()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            states.append(text[text.rindex(")") + 2])  # the field after the command's name
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"pid {pid}'s threads not all stopped after {timeout_s} s: {states}"


def test_a_stopped_rank_raises_worker_error_at_the_step_deadline_and_every_rank_is_ended(model_dir):
    """SIGSTOP: no error and no closed stream, only silence; the step deadline (from measured step times, here a
    1 s floor) turns it into WorkerError instead of a wait for torch's or gRPC's timeouts."""
    executor, workers = _local_tp2(model_dir, deadline=StepDeadline(floor_s=1.0, initial_s=1.0))
    stopped = workers.processes[1].pid
    try:
        assert executor.execute(StepPlan(1)).step_id == 1
        _stop(stopped)
        with pytest.raises(WorkerError, match=r"ranks \[(0, )?1\] did not answer within 1.0 s"):
            executor.execute(StepPlan(2))
        for proc in workers.processes:  # the executor stopped its workers: a stopped one is killed
            proc.join(timeout=30)
        assert not any(proc.is_alive() for proc in workers.processes)
    finally:
        if workers.processes[1].is_alive():
            os.kill(stopped, signal.SIGCONT)
        executor.shutdown()


def test_ranks_sharing_a_host_are_refused_caches_it_cannot_hold_together(model_dir):
    """Two CPU ranks on this host, each asking for 60% of its available memory: each passes its own check, the
    executor refuses the pair at start-up, in one line naming both ranks, and ends them (before any cache exists)."""
    from shardserve.worker.kv_cache import bytes_per_block, host_memory

    host, available = host_memory(torch.device("cpu"))
    assert host and available > 0
    single = InProcessExecutor(engine_config(model_dir))
    per_rank_block = bytes_per_block(single.runner.model, single.runner.block_size, torch.float32) // 2  # KV heads / 2
    single.shutdown()
    blocks = int(0.6 * available) // per_rank_block
    config = engine_config(model_dir, tensor_parallel_size=2, num_kv_blocks=blocks)
    workers = start_local_workers(config)
    with pytest.raises(ValueError, match=r"ranks 0, 1, which share one host, would take .* GiB together "
                                         rf"\({blocks} blocks each\), more than the .* GiB"):
        GrpcExecutor(config, workers.endpoints, workers.init_method, stop_workers=workers.stop, secret=workers.secret)
    for proc in workers.processes:
        proc.join(timeout=30)
    assert not any(proc.is_alive() for proc in workers.processes)
