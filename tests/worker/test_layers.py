"""The TP building blocks on their own: numerics against transformers' layers, and which slice each rank loads.

Sharding is checked in-process by giving the TP state object a rank and size (no collectives are run);
the end-to-end TP forward over gloo is in test_models.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from shardserve.worker import distributed
from shardserve.worker.layers.activation import SiluAndMul
from shardserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardserve.worker.layers.norm import RMSNorm
from shardserve.worker.layers.rotary import RotaryEmbedding, rope_settings
from shardserve.worker.loader import init_dummy_weights
from shardserve.worker.models.registry import build_model
from shardserve.kernels.torch_backend import TorchAttentionBackend


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(distributed, "_group", distributed._TPGroup(rank=rank, size=size))

    return set_rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [32, 576])
def test_rmsnorm_equals_hf_bit_for_bit_and_fused_residual_equals_add_then_norm(dtype, hidden):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(hidden, eps=1e-5).to(dtype), LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    for rows, scale in ((1, 1.0), (5, 30.0), (300, 0.01)):
        x, residual = (torch.randn(rows, hidden) * scale).to(dtype), torch.randn(rows, hidden).to(dtype)
        assert torch.equal(ours(x), theirs(x))
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(normed, theirs(x + residual))


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}],
)
def test_rotary_matches_hf_including_llama3_scaling(rope_scaling):
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=1024,
                         rope_theta=5e5, rope_scaling=rope_scaling)
    theta, scaling = rope_settings(config)
    ours = RotaryEmbedding(32, 1024, theta, scaling)
    positions = torch.tensor([0, 1, 7, 300, 1023])
    q, k = torch.randn(5, 2, 32), torch.randn(5, 1, 32)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_the_qkv_output_equals_forward_step_after_step(dtype):
    rotary = RotaryEmbedding(16, 64, 1e4)
    heads, kv_heads = 4, 2
    for step, positions in enumerate([torch.tensor([0, 5, 9]), torch.tensor([1, 6, 10]), torch.tensor([3, 3, 63])]):
        qkv = torch.randn(3, (heads + 2 * kv_heads) * 16, generator=torch.Generator().manual_seed(step)).to(dtype)
        q = qkv[:, : heads * 16].reshape(3, heads, 16)
        k = qkv[:, heads * 16 : (heads + kv_heads) * 16].reshape(3, kv_heads, 16)
        v_before = qkv[:, (heads + kv_heads) * 16 :].clone()
        q_ref, k_ref = rotary(positions, q.clone(), k.clone())
        for _ in range(2):  # the second layer of a step reuses the step's cos/sin; a new step's positions do not
            q_ref, k_ref = rotary(positions, q_ref, k_ref) if _ else (q_ref, k_ref)
            rotary.rotate_(positions, qkv[:, : (heads + kv_heads) * 16].view(3, heads + kv_heads, 16))
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
        assert torch.equal(qkv[:, (heads + kv_heads) * 16 :], v_before)


def test_unsupported_rope_type_is_rejected():
    config = LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        rope_settings(config)


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


def test_qkv_ranks_load_their_heads_and_share_replicated_kv_heads(as_rank):
    heads, kv_heads, dim, hidden = 4, 2, 3, 5
    q_w = torch.arange(heads * dim * hidden, dtype=torch.float32).reshape(heads * dim, hidden)
    k_w, v_w = q_w[: kv_heads * dim] + 1000, q_w[: kv_heads * dim] + 2000
    for tp in (1, 2, 4):  # tp 4 > 2 KV heads: ranks 0,1 hold KV head 0; ranks 2,3 KV head 1
        for rank in range(tp):
            as_rank(rank, tp)
            layer = QKVParallelLinear(hidden, dim, heads, kv_heads)
            for shard, w in (("q", q_w), ("k", k_w), ("v", v_w)):
                layer.weight_loader(layer.weight, w, shard)
            q, k, v = layer.split(layer.weight.T)
            hpr, kvpr = heads // tp, max(1, kv_heads // tp)
            kv_head = rank * kvpr if tp <= kv_heads else rank // (tp // kv_heads)
            assert torch.equal(q.T, q_w[rank * hpr * dim : (rank + 1) * hpr * dim])
            assert torch.equal(k.T, k_w[kv_head * dim : (kv_head + kvpr) * dim])
            assert torch.equal(v.T, v_w[kv_head * dim : (kv_head + kvpr) * dim])


def test_tp_above_kv_heads_must_be_a_multiple_of_them(as_rank):
    as_rank(0, 4)
    with pytest.raises(ValueError, match="multiple"):
        QKVParallelLinear(16, 2, num_heads=12, num_kv_heads=3)


def test_merged_and_row_parallel_slices(as_rank):
    gate, up, down = torch.randn(8, 3), torch.randn(8, 3), torch.randn(3, 8)
    as_rank(1, 2)
    merged = MergedColumnParallelLinear(3, [8, 8])
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[4:], up[4:]]))
    row = RowParallelLinear(8, 3)
    row.weight_loader(row.weight, down)
    assert torch.equal(row.weight, down[:, 4:])


def test_vocab_shards_pad_the_last_rank_and_tied_head_shares_the_weight(as_rank):
    table = torch.randn(7, 4)
    as_rank(1, 2)  # rows 4..6 real, row 7 padding
    embedding = VocabParallelEmbedding(7, 4)
    embedding.weight_loader(embedding.weight, table)
    assert torch.equal(embedding.weight[:3], table[4:]) and torch.equal(embedding.weight[3], torch.zeros(4))
    head = ParallelLMHead(7, 4, tied_to=embedding)
    assert head.weight is embedding.weight


def test_dummy_weights_are_one_global_tensor_sliced_per_rank(as_rank):
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=33, max_position_embeddings=64)
    config.architectures = ["LlamaForCausalLM"]

    def dummy_model(rank: int, tp: int):
        as_rank(rank, tp)
        model = build_model(config, torch.float32, torch.device("cpu"), TorchAttentionBackend())
        init_dummy_weights(model, seed=7)
        return dict(model.named_parameters())

    full, rank0, rank1 = dummy_model(0, 1), dummy_model(0, 2), dummy_model(1, 2)
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([rank0[down], rank1[down]], dim=1), full[down])
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([rank0[embed], rank1[embed]])[:33], full[embed])
    assert 0.015 < full[down].std().item() < 0.025
    assert torch.equal(full["model.norm.weight"], torch.ones(32))
    assert not torch.equal(full["lm_head.weight"], full[embed])  # untied: its own tensor


def test_single_rank_collectives_are_identity_and_destroy_returns():
    distributed.init_distributed(0, 1, "tcp://127.0.0.1:1", "gloo", 1.0)  # no rendezvous at world size 1
    x = torch.randn(3, 4)
    assert distributed.all_reduce(x) is x
    assert distributed.all_gather_last_dim(x) is x
    assert (distributed.tp_rank(), distributed.tp_size()) == (0, 1)
    distributed.destroy_distributed(1.0)
