"""bench gemm_rates' plumbing on CPU (the timing itself runs on a GPU): with the graph timer replaced by one call
of each case, a tiny model's projections and layer chains go through cuBLAS's stand-in and the split-K GEMM (in
Triton's interpreter), and the report names the best setting per projection and the chain variants."""

from shardserve.bench import attention_rates, gemm_rates


def test_report_names_each_projection_and_chain(tiny_model, monkeypatch):
    calls = []

    def once(fns, launches=24, rounds=7):
        fns[0]()
        calls.append(len(fns))
        return 0.001

    monkeypatch.setattr(attention_rates, "graph_ms", once)
    folder = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    configs = [(16, 16, 32, 1, 4, 1), (16, 16, 32, 2, 4, 1)]
    report = gemm_rates.gemm_rates(folder, [3], 1e12, configs=configs, device="cpu")
    assert [r["projection"] for r in report["rows"]] == ["qkv", "o_proj", "gate_up", "down"]
    assert all(r["best_config"] in configs and len(r["configs"]) == 2 for r in report["rows"])
    (chain,) = report["chains"]
    assert {"cublas_us", "split_k_us", "split_k_no_pdl_us", "split_k_o_down_only_us"} <= set(chain)
    assert len(calls) == 4 * 3 + 4  # per projection cuBLAS and two settings, then four chains
