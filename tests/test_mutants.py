"""The suite catches the bugs its tests are named for: each planted bug (a mutant) is run against the test named for
its feature, in a subprocess, and that test must fail. A mutant that survives, or whose text no longer occurs once
in its module (the code moved: update the mutant), fails here.

Each mutant costs one pytest subprocess (tests/mutants/plugin.py plants it through an import hook), so the named
tests are the cheap, in-process ones for their feature.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    module: str  # the module whose source is changed
    old: str  # text that occurs once in it
    new: str  # what the bug puts there
    test: str  # the pytest node id that must fail


MUTANTS = {
    # the server ends the live streams of a replica whose TP group is being replaced (UNAVAILABLE), instead of
    # carrying them over to the new group
    "recovery-carry-over": Mutant(
        "shardserve.cluster.front",
        "            self.router.forget(self._position[replica.id])\n        if self.state is State.SERVING:",
        "            self.router.forget(self._position[replica.id])\n"
        "            for live in [live for live in self._live.values() if live.replica is replica]:\n"
        "                self._end(live.req_id, ServerUnavailable('recovering'), outcome='error')\n"
        "        if self.state is State.SERVING:",
        "tests/e2e/test_faults_local.py::test_sigkill_of_a_rank_with_16_streams_loses_no_request_and_changes_no_token"),
    # a prefix hit's block table written from its first uncached block only (the cached ids left out)
    "prefix-cache-table": Mutant(
        "shardserve.worker.input_batch",
        "tables.write(state.table_row, 0, state.block_ids)",
        "tables.write(state.table_row, req.num_computed_tokens // 4, "
        "state.block_ids[req.num_computed_tokens // 4:])",
        "tests/worker/test_model_runner.py::test_prefix_cache_hit_reuses_blocks_filled_by_an_earlier_request"),
    # the decode attention's softmax scale 0.1% off: every greedy token survives it, the logprobs do not
    "decode-attention-scale": Mutant(
        "shardserve.kernels.torch_backend",
        "self._decode(q, out, k_cache, v_cache, meta, scale,",
        "self._decode(q, out, k_cache, v_cache, meta, scale * 1.001,",
        "tests/test_llm_correctness.py::test_tiny_models_greedy_match_transformers_with_chunks_and_preemption"
        "[llama-tied-gqa]"),
    # out of blocks, the scheduler preempts the earliest arrival instead of the latest
    "preemption-victim": Mutant(
        "shardserve.cluster.scheduler",
        "victim = self.running[-1]",
        "victim = self.running[0]",
        "tests/cluster/test_scheduler.py::test_preemption_takes_the_latest_arrival_and_resends_all_its_tokens"),
    # an evicted block stays in the router's prefix index under the replica that evicted it
    "router-eviction": Mutant(
        "shardserve.cluster.router",
        "mask = index.get(h, 0) & ~bit",
        "mask = index.get(h, 0)",
        "tests/cluster/test_router.py::test_evicted_blocks_leave_the_index_and_a_failed_replica_is_forgotten"),
    # a rank applies a plan whose step id skips ahead or goes back
    "worker-step-id": Mutant(
        "shardserve.worker.step_loop",
        "if plan.step_id != self.last_step_id + 1:",
        "if plan.step_id == self.last_step_id:",
        "tests/worker/test_step_loop.py::test_a_plan_out_of_order_is_refused_not_applied_and_the_rank_stays_ready"),
    # a seeded row's draw ignores the index of the token being generated: every step draws the same uniform
    "seeded-draw": Mutant(
        "shardserve.worker.sampling_keys",
        "return splitmix64(_seed_hash(seed) ^ (output_index & _MASK64))",
        "return splitmix64(_seed_hash(seed))",
        "tests/worker/test_sampler.py::test_draws_depend_on_seed_and_token_index"),
}


def run_with_mutant(mutant: Mutant | None, *tests: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_XDIST", "MUTANT_")) and key != "PYTEST_ADDOPTS"}
    if mutant is not None:
        env.update(MUTANT_MODULE=mutant.module, MUTANT_OLD=mutant.old, MUTANT_NEW=mutant.new)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "tests.mutants.plugin", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_test_named_for_a_feature_fails_on_its_planted_bug(name):
    mutant = MUTANTS[name]
    result = run_with_mutant(mutant, mutant.test)
    tail = (result.stdout + result.stderr)[-3000:]
    assert "the mutant's text occurs" not in tail, tail
    assert result.returncode == 1, f"{name}: the mutant survived (exit {result.returncode}):\n{tail}"
    assert "failed" in result.stdout.splitlines()[-1], tail


def test_the_plugin_without_a_mutant_leaves_the_named_tests_passing():
    """Without the plant the same subprocess passes: the failures above are the mutants', not the harness's."""
    tests = [MUTANTS[name].test for name in ("router-eviction", "worker-step-id", "seeded-draw")]
    result = run_with_mutant(None, *tests)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
