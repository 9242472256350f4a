"""The FP8 KV cache through the engine on CPU (torch backend): twice the blocks in the same memory, scales calibrated
per layer and KV head (or taken from the checkpoint), and outputs that do not depend on chunked prefill,
preemption or prefix-cache hits (each position's K/V is quantized once, with fixed scales)."""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file, save_file

from shardserve import LLM, SamplingParams
from shardserve.settings.resolve import build_engine_config
from shardserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_an_fp8_cache_holds_twice_the_blocks_and_calibrates_its_scales(tiny_model):
    folder = tiny_model("qwen3", num_heads=6, num_kv_heads=3, intermediate_size=192, seed=3)
    counts, runners = {}, {}
    for kv in ("auto", "fp8"):
        config = build_engine_config(model=folder, device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.001,
                                     kv_cache_dtype=kv)
        runners[kv] = ModelRunner(config)
        counts[kv] = runners[kv].profile_num_blocks()
    assert counts["fp8"] // 2 == counts["auto"]  # half the bytes of a bf16 cache (floors of one budget)
    runner = runners["fp8"]
    runner.allocate_kv_cache(counts["fp8"])
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    scales = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in runner.model.model.layers]
    assert all(s.shape == (3,) and bool((s > 0).all()) for pair in scales for s in pair)
    assert len({round(float(s), 9) for pair in scales for s in torch.cat(pair)}) > 6  # per layer and head, not one value
    assert all(bool((layer.self_attn.attn.k_scale == 1).all()) for layer in runners["auto"].model.model.layers)


def test_checkpoint_kv_scales_are_used_instead_of_calibration(tiny_model, tmp_path):
    source = tiny_model("llama", num_heads=4, num_kv_heads=2)
    folder = tmp_path / "with-scales"
    folder.mkdir()
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(source, name), folder / name)
    tensors = {}
    for path in glob.glob(os.path.join(source, "*.safetensors")):
        tensors.update(load_file(path))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.125)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.5, 0.25])  # one per KV head
    save_file(tensors, folder / "model.safetensors")
    runner = ModelRunner(build_engine_config(model=str(folder), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=8))
    first, second = (layer.self_attn.attn for layer in runner.model.model.layers[:2])
    assert first.scales_from_checkpoint and first.k_scale.tolist() == [0.125, 0.125]
    assert first.v_scale.tolist() == [0.5, 0.25]
    assert not second.scales_from_checkpoint and not bool((second.k_scale == 1).all())  # calibrated
    # without fp8 the scales in the checkpoint are ignored, and loading still works
    ModelRunner(build_engine_config(model=str(folder), device="cpu", num_kv_blocks=8))


def test_fp8_outputs_are_the_same_with_chunks_preemption_and_prefix_hits(tiny_model):
    folder = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    shared = [7 * i % 300 + 5 for i in range(40)]  # a 40-token prefix every prompt starts with: prefix-cache hits
    prompts = [shared + [(13 * i + j) % 300 + 5 for j in range(3 + 5 * i)] for i in range(6)]
    outputs = {}
    for name, settings in {
        "plain": dict(enable_prefix_caching=False),
        "squeezed": dict(max_num_batched_tokens=24, num_kv_blocks=12),  # chunks, preemption, prefix hits
    }.items():
        llm = LLM(model=folder, kv_cache_dtype="fp8", max_model_len=256, **settings)
        try:
            results = llm.generate(prompts, GREEDY, use_tqdm=False)
            outputs[name] = [o.outputs[0].token_ids for o in results]
            if name == "squeezed":
                assert llm.engine.stats().num_preemptions > 0
                assert any(o.num_cached_tokens > 0 for o in results)
                assert llm.engine.block_manager.all_free()
        finally:
            llm.shutdown()
    assert outputs["plain"] == outputs["squeezed"]


def test_fp8_at_tp2_gives_tp1s_tokens(tiny_model):
    """Each rank calibrates and holds the scales of its own KV heads: the split changes nothing but summation order,
    so the first difference from TP=1, if any, must be a near-tie in TP=1's own logprobs."""
    folder = tiny_model("llama", tie_word_embeddings=True, num_heads=4, num_kv_heads=2)
    prompts = [[(31 * i + 7 * j) % 300 + 5 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for tp in (1, 2):
        with LLM(model=folder, tensor_parallel_size=tp, kv_cache_dtype="fp8", max_model_len=256, num_kv_blocks=40) as llm:
            runs[tp] = llm.generate(prompts, params, use_tqdm=False)
    for one, two in zip(runs[1], runs[2]):
        one, two = one.outputs[0], two.outputs[0]
        for pos, (a, b) in enumerate(zip(one.token_ids, two.token_ids)):
            if a != b:
                lp = one.logprobs[pos]  # {token id: Logprob}, the chosen token first
                assert b in lp and abs(lp[a].logprob - lp[b].logprob) < 1e-3, (pos, a, b)
                break
