"""The CPU's packed weights (worker/layers/cpu_packed.py): the linear layers and the LM head give F.linear's results
(to float rounding) after packing, a packed model still matches transformers, and packing can be turned off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.worker import distributed
from shardserve.worker.layers import cpu_packed
from shardserve.worker.layers.embedding import ParallelLMHead
from shardserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tests.worker.test_models import ATOL, CONFIGS, PagedRunner, hf_logits, load_ours, prompt, save_hf_model

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def single_rank():
    distributed.init_distributed(0, 1, "", "gloo", 10.0)


def _filled(layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn_like(p, dtype=dtype)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 33])
def test_packed_layers_equal_f_linear_and_hold_one_copy(dtype, rows):
    layers = [
        _filled(QKVParallelLinear(48, 8, 4, 2, bias=True), dtype),
        _filled(MergedColumnParallelLinear(48, [40, 40]), dtype),
        _filled(RowParallelLinear(80, 48), dtype),
    ]
    for layer in layers:
        x = torch.randn(rows, layer.weight.shape[1], dtype=dtype)
        expected = layer(x)
        plain = layer.weight.detach().clone()
        assert layer.pack_weights(), f"{type(layer).__name__} was not packed"
        assert layer.weight.is_mkldnn and tuple(layer.weight.shape) == tuple(plain.shape)
        assert "weight" not in dict(layer.named_parameters()), "the plain weight is still held beside the packed one"
        torch.testing.assert_close(layer(x), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_lm_head_keeps_the_tied_embedding_weight(dtype):
    head = _filled(ParallelLMHead(100, 48), dtype)
    hidden = torch.randn(5, 48, dtype=dtype)
    expected = F.linear(hidden, head.weight)
    assert head.pack_weights()
    assert not head.weight.is_mkldnn  # the embedding's lookup reads it
    torch.testing.assert_close(head(hidden), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_model_matches_transformers_through_prefill_and_decodes(name, tmp_path):
    hf = save_hf_model(name, tmp_path)
    model = load_ours(tmp_path, hf.config)
    layers = hf.config.num_hidden_layers
    assert cpu_packed.pack_model(model) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the LM head
    tokens = prompt(12, hf.config.vocab_size, seed=3)
    runner = PagedRunner(model)
    (prefill,) = runner.step([("a", tokens[:9])])
    decodes = [runner.step([("a", [t])])[0] for t in tokens[9:]]
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(prefill, expected[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(decodes), expected[9:], atol=ATOL, rtol=0)


def test_packing_turned_off_keeps_the_plain_weights(monkeypatch):
    monkeypatch.setattr(cpu_packed, "ENABLED", False)
    layer = _filled(RowParallelLinear(32, 16), torch.float32)
    assert not layer.pack_weights()
    assert isinstance(layer.weight, torch.nn.Parameter) and not layer.weight.is_mkldnn
