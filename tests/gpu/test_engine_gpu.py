"""GPU suite, engine level: decode through captured CUDA graphs gives the eager path's greedy output (TP=1, and
TP=2 with the all-reduces inside the graphs where two GPUs are present), and the KV sizing's reserve for the
graphs covers what the capture really takes. Runs only on a CUDA host (make test-gpu).

Greedy outputs are compared with the near-tie rule: padding changes matmul shapes and the graphs' fixed split
count changes summation order, so a first difference is accepted only where the other token is in the eager run's own
top 5 within TIE of its greedy token's logprob."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
TIE = 0.02  # fp32 on the GPU: Triton's tl.dot takes tf32 inputs, so two correct paths differ by ~1e-3
PROMPTS = [[(31 * i + 7 * j) % 500 + 3 for j in range(5 + 7 * i)] for i in range(6)]  # 6 rows: padded to 8
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.hf_reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpu-tiny-qwen3"), "qwen3", num_heads=4, num_kv_heads=2,
                           head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=512)


def generate(model_dir: str, prompts: list | None = None, dtype: str = "float32", logprobs: int = 1,
             **kwargs) -> tuple[list, dict]:
    """Greedy outputs (with top-`logprobs` logprobs) of a fresh LLM, and what it said about its graphs."""
    from shardserve import LLM, SamplingParams

    llm = LLM(model=model_dir, device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=512, num_kv_blocks=256,
              **kwargs)
    info = {}
    try:
        runner = getattr(llm.executor, "runner", None)
        if runner is not None:  # in-process (TP=1): count the steps the graphs served
            info["graphs"] = runner.decode_graphs
            info["served"] = served = []
            if runner.decode_graphs is not None:
                inner = runner.decode_graphs.run

                def counting(*args, **kw):
                    out = inner(*args, **kw)
                    served.append(out is not None)
                    return out

                runner.decode_graphs.run = counting
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
        outputs = llm.generate(PROMPTS if prompts is None else prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return outputs, info


@pytest.fixture(scope="module")
def eager(model_dir):
    outputs, info = generate(model_dir, logprobs=5, enforce_eager=True)  # top 5: a differing token can be judged
    assert info["graphs"] is None  # enforce_eager: nothing captured
    return outputs


def assert_greedy_equal_or_near_tie(reference, outputs) -> None:
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        for pos, (a, b) in enumerate(zip(ref.outputs[0].token_ids, out.outputs[0].token_ids)):
            if a == b:
                continue
            lp = ref.outputs[0].logprobs[pos]  # {token id: Logprob}: eager's token first, then its top N
            assert b in lp, f"prompt {i} pos {pos}: {b} vs eager {a}, not in eager's top {list(lp)}"
            gap = lp[a].logprob - lp[b].logprob
            assert abs(gap) < TIE, f"prompt {i} pos {pos}: {b} vs eager {a} with a logprob gap of {gap:.4f}"
            break


def test_greedy_with_decode_graphs_equals_eager(model_dir, eager):
    outputs, info = generate(model_dir)
    graphs = info["graphs"]
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    assert info["served"] and all(info["served"])  # every decode step replayed a graph
    assert graphs.memory_bytes > 0
    assert_greedy_equal_or_near_tie(eager, outputs)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_bs1_bf16_one_row_layers_equal_the_layer_by_layer_path(model_dir, enforce_eager, monkeypatch):
    """One prompt at a time (decode at batch 1) in bf16: the one-row layers (four fused GEMVs a layer, _fused.one_row)
    give the layer-by-layer path's greedy tokens, eagerly and inside the batch-1 graph."""
    from shardserve.worker.layers import _fused
    from shardserve.worker.models.decoder import DecoderLayer

    calls = []
    original = DecoderLayer.forward_one_row
    monkeypatch.setattr(DecoderLayer, "forward_one_row", lambda self, *a: calls.append(1) or original(self, *a))
    prompts = PROMPTS[1:2]
    monkeypatch.setattr(_fused, "ONE_ROW", False)
    plain, _ = generate(model_dir, prompts, "bfloat16", logprobs=5, enforce_eager=True)
    assert not calls
    monkeypatch.setattr(_fused, "ONE_ROW", True)
    one_row, _ = generate(model_dir, prompts, "bfloat16", enforce_eager=enforce_eager)
    assert calls  # the layers took the one-row path (in the graph: at capture)
    assert_greedy_equal_or_near_tie(plain, one_row)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_with_all_reduces_inside_the_graphs_equals_tp1_eager(model_dir, eager):
    outputs, _ = generate(model_dir, tensor_parallel_size=2)
    assert_greedy_equal_or_near_tie(eager, outputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_on_the_gpu_in_fp32_equals_transformers(arch, tmp_path):
    """The whole GPU path (fused layer kernels, Triton attention in full fp32, decode graphs) against transformers'
    fp32 greedy tokens (computed on the CPU), with the project's near-tie rule (1e-3 in transformers' logits)."""
    from tests.hf_reference import assert_greedy_match, hf_greedy, make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256,
                             intermediate_size=512, vocab_size=512)
    outputs, info = generate(folder)
    assert info["graphs"] is not None and all(info["served"])  # the decode steps ran through the graphs
    for output, ref in zip(outputs, hf_greedy(folder, PROMPTS, MAX_TOKENS)):
        assert_greedy_match(output.outputs[0].token_ids, ref)


def test_kv_sizing_reserves_at_least_what_the_graphs_take():
    """Qwen3-0.6B shapes (dummy weights), 64 sequences: the dry-run reserve against the real capture."""
    from shardserve.settings.resolve import build_engine_config
    from shardserve.worker.model_runner import ModelRunner

    config = build_engine_config(model="qwen3-0.6b", device="cuda", max_num_seqs=64, max_model_len=2048,
                                 gpu_memory_utilization=0.5)
    runner = ModelRunner(config)
    try:
        blocks = runner.profile_num_blocks()
        reserve = runner._graph_reserve
        runner.allocate_kv_cache(min(blocks, 2048))
        graphs = runner.decode_graphs
        assert reserve is not None and reserve > 0
        assert graphs is not None and len(graphs.batch_sizes) == 11
        assert graphs.memory_bytes <= reserve + (2 << 20), (graphs.memory_bytes, reserve)  # + one 2 MiB granule
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()
