"""GPU suite, speculative decoding: n-gram drafts verified on the GPU (the extend kernel scores the k + 1 rows)
give the greedy output of plain decoding (through its CUDA graphs), by the engine suite's near-tie rule, with
drafts proposed and accepted; and `bench latency` runs the grounded workload with speculation on a built-in
architecture's dummy weights (the GPU benchmark's command, shortened). Runs only on a CUDA host."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.test_engine_gpu import assert_greedy_equal_or_near_tie, generate  # noqa: E402

pytestmark = pytest.mark.gpu
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# motifs repeated in each prompt: the tiny random model copies some of them, so drafts get accepted
REPEATING = [([40 + 5 * i + j for j in range(3 + i % 3)] * 6)[: 12 + 4 * i] for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.hf_reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpu-tiny-spec"), "llama", num_heads=4, num_kv_heads=2,
                           head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=512)


def test_ngram_speculation_on_the_gpu_gives_plain_decodings_greedy_output(model_dir):
    plain, _ = generate(model_dir, REPEATING, logprobs=5)
    spec, info = generate(model_dir, REPEATING, logprobs=5, speculative_config=NGRAM)
    assert_greedy_equal_or_near_tie(plain, spec)


def test_bench_latency_runs_the_grounded_workload_with_speculation_on_dummy_weights(tmp_path):
    from shardserve.cli.main import main as cli

    out = tmp_path / "record.json"
    assert cli(["bench", "latency", "--model", "qwen3-0.6b", "--load-format", "dummy", "--device", "cuda",
                "--workload", "grounded", "--input-len", "64", "--output-len", "16", "--max-model-len", "256",
                "--no-roofline", "--speculative-config", json.dumps(NGRAM), "--json-out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["notes"]["speculation"]["num_drafts"] > 0
