"""The decode CUDA-graph path (worker/cuda_graphs.py) checked on CPU: bucketing, the staging layout and the slot
mapping computed from it, and whole decode steps through the padded static-buffer path (run eagerly:
use_cuda_graphs=False) on the Triton kernels in interpreter mode, against the runner's ordinary eager path.
What only a GPU can show (capture, replay, memory) is in tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, StepResult, cdiv
from shardserve.worker.block_tables import DeviceBlockTables
from shardserve.worker.cuda_graphs import (
    DecodeGraphRunner,
    graph_batch_sizes,
    graphs_unsupported_reason,
    padded_batch_size,
)
from shardserve.worker.step_inputs import decode_inputs_from_staging
from shardserve.worker.step_inputs import pack_inputs as pack_decode_inputs
from shardserve.worker.model_runner import ModelRunner

BLOCK = 4
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 1, 33, 8, 60], [200, 13, 77, 41, 9], [11, 12, 13]]
DECODE_STEPS = 5


def test_batch_sizes_are_powers_then_multiples_of_8_up_to_max_num_seqs():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(100)[-2:] == [96, 100]
    assert graph_batch_sizes(4096)[-1] == 512  # capped: larger decode batches run eagerly


def test_every_batch_pads_to_the_nearest_captured_size_and_larger_ones_go_eager():
    sizes = graph_batch_sizes(256)
    for n in range(1, 257):
        padded = padded_batch_size(n, sizes)
        assert padded in sizes and n <= padded < n + 8
    assert padded_batch_size(3, sizes) == 4 and padded_batch_size(9, sizes) == 16
    assert padded_batch_size(257, sizes) is None and padded_batch_size(0, sizes) is None


def test_staging_yields_the_eager_slots_and_masks_padding_rows():
    tables, tokens = [[3, 7, 6], [5], [9, 2, 4]], [101, 102, 103]
    positions = [9, 2, 10]  # with block size 4: entry 2, 0 and 2 of each table
    device_tables = DeviceBlockTables(rows=2, cols=1)  # small: the writes below grow it
    rows = [device_tables.assign() for _ in tables][::-1]  # rows 2, 1, 0: a request's table row is not its batch row
    for row, table in zip(rows, tables):
        device_tables.write(row, 0, table)
    flat = pack_decode_inputs(tokens, positions, rows, padded=4)
    assert flat == tokens + [0] + positions + [0] + [10, 3, 11, 0] + rows
    largest, max_blocks, width = 8, 6, 3
    staging = torch.full((4 * largest,), 999, dtype=torch.int64)  # stale garbage
    staging[: len(flat)] = torch.tensor(flat)
    block_tables = torch.full((largest, max_blocks), 5, dtype=torch.int32)  # stale rows for the padding
    block_tables[:3, :width] = device_tables.gather(staging[12:15], width)
    assert block_tables[:3, :width].tolist() == [[3, 7, 6], [5, 0, 0], [9, 2, 4]]
    ids, pos, meta = decode_inputs_from_staging(
        staging, block_tables, torch.arange(largest + 1, dtype=torch.int32), padded=4, block_size=BLOCK, max_seq_len=64
    )
    assert ids.tolist() == [101, 102, 103, 0] and pos.tolist() == [9, 2, 10, 0]
    assert meta.seq_lens.tolist() == [10, 3, 11, 0]  # padding row: no context, so no keys are read
    expected = [6 * BLOCK + 1, 5 * BLOCK + 2, 4 * BLOCK + 2, -1]  # padding row: slot -1, nothing stored
    assert meta.slot_mapping.tolist() == expected
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.is_decode_only and meta.num_seqs == 4


def test_graphs_only_on_cuda_with_the_triton_backend_and_not_when_eager_is_enforced(tmp_path):
    from shardserve.kernels.torch_backend import TorchAttentionBackend

    config = EngineConfig(model=str(tmp_path))
    triton_like = type("B", (), {"name": "triton"})()
    assert graphs_unsupported_reason(config, torch.device("cpu"), triton_like) == "not on CUDA"
    assert graphs_unsupported_reason(config, torch.device("cuda", 0), triton_like) is None
    assert "not graph-safe" in graphs_unsupported_reason(config, torch.device("cuda", 0), TorchAttentionBackend())
    eager = EngineConfig(model=str(tmp_path), enforce_eager=True)
    assert graphs_unsupported_reason(eager, torch.device("cuda", 0), triton_like) == "enforce_eager is set"


# ---- whole decode steps through the padded path ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-graphs"), "qwen3")


def make_runner(model_dir: str, max_model_len: int, graph_sizes: list[int] | None) -> tuple[ModelRunner, list[int]]:
    """A CPU runner on the Triton kernels (interpreted); graph_sizes attaches the padded path, run eagerly, and
    returns a list that counts the steps it served."""
    config = EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=32, max_model_len=max_model_len,
                          max_num_seqs=4, max_num_batched_tokens=64, attention_backend="triton")
    runner = ModelRunner(config)
    runner.allocate_kv_cache(32)
    served: list[int] = []
    if graph_sizes is not None:
        graphs = DecodeGraphRunner(runner.model, runner.kv_caches, runner.attn_backend, graph_sizes, BLOCK,
                                   max_model_len, runner.device, use_cuda_graphs=False)
        inner_run = graphs.run

        def counting_run(*args, **kwargs):
            out = inner_run(*args, **kwargs)
            if out is not None:
                served.append(args[0].num_seqs)
            return out

        graphs.run = counting_run
        runner.decode_graphs = graphs
    return runner, served


def run_overlapped(runner: ModelRunner, spec: SamplingSpec | None = None) -> list[StepResult]:
    """A prefill of all prompts, then decode steps, each launched before the previous one is finished (so decode
    inputs are tokens still on the device: StepInputs.gather_pending). Default: greedy with top-1 logprobs."""
    greedy = spec or SamplingSpec(temperature=0.0, logprobs=1)
    blocks = iter(range(32))
    new = [NewRequest(str(i), list(p), len(p), 0, [next(blocks) for _ in range(cdiv(len(p) + DECODE_STEPS, BLOCK))],
                      greedy) for i, p in enumerate(PROMPTS)]
    ids = [r.req_id for r in new]
    plans = [StepPlan(1, new_requests=new, req_ids=ids, num_tokens=[len(p) for p in PROMPTS])]
    plans += [StepPlan(2 + k, req_ids=ids, num_tokens=[1] * len(ids)) for k in range(DECODE_STEPS)]
    results, in_flight = [], None
    for plan in plans:
        launched = runner.launch_step(plan)
        if in_flight is not None:
            results.append(runner.finish_step(in_flight))
        in_flight = launched
    results.append(runner.finish_step(in_flight))
    return results


def assert_same_tokens_or_near_tie(eager: list[StepResult], graphed: list[StepResult], tie: float = 1e-3) -> None:
    """Equal greedy tokens per request; a first difference is accepted only at a near-tie of the eager logprobs
    (padding changes matmul shapes, and a split count changes summation order)."""
    for req in range(len(PROMPTS)):
        for step_e, step_g in zip(eager, graphed):
            token_e, token_g = step_e.token_ids[req], step_g.token_ids[req]
            if token_e != token_g:
                lp = step_e.logprobs[req]
                assert token_g in lp.top_ids, f"request {req}: {token_g} is not even in eager's top {lp.top_ids}"
                gap = lp.logprob - lp.top_logprobs[lp.top_ids.index(token_g)]
                assert abs(gap) < tie, f"request {req}: tokens differ ({token_e} vs {token_g}) with a gap of {gap}"
                break


def assert_same_top_logprobs(eager_results, graphed_results) -> None:
    """Where a step's top tokens agree, their logprobs agree (1e-4)."""
    for step_e, step_g in zip(eager_results, graphed_results):
        for lp_e, lp_g in zip(step_e.logprobs, step_g.logprobs):
            if lp_e.top_ids == lp_g.top_ids:
                assert lp_g.top_logprobs == pytest.approx(lp_e.top_logprobs, abs=1e-4)


@pytest.mark.parametrize("max_model_len", [64, 512])  # 512: the graph's fixed split count (8) differs from eager's (1)
def test_padded_decode_path_gives_the_eager_tokens(model_dir, max_model_len):
    eager, _ = make_runner(model_dir, max_model_len, None)
    graphed, served = make_runner(model_dir, max_model_len, graph_batch_sizes(4))
    if max_model_len == 512:
        assert graphed.decode_graphs.num_splits(4) > 1
    eager_results, graphed_results = run_overlapped(eager), run_overlapped(graphed)
    assert served == [3] * DECODE_STEPS  # every decode step (3 rows, padded to 4) took the padded path
    assert [r.req_ids for r in graphed_results] == [r.req_ids for r in eager_results]
    assert_same_tokens_or_near_tie(eager_results, graphed_results)
    assert_same_top_logprobs(eager_results, graphed_results)


def test_a_batch_larger_than_every_captured_size_runs_eagerly(model_dir):
    eager, _ = make_runner(model_dir, 64, None)
    graphed, served = make_runner(model_dir, 64, [1, 2])  # 3 rows fit no size
    eager_tokens = [r.token_ids for r in run_overlapped(eager)]
    assert [r.token_ids for r in run_overlapped(graphed)] == eager_tokens
    assert served == []


