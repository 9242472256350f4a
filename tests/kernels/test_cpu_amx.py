"""The AMX matmul for a decode step's few rows (kernels/cpu_amx.c, cpu_native.linear_amx), reading the weights
oneDNN packed, against float32 sums of the same bfloat16 products rounded as torch rounds: row counts across and off
its 32-row chunks, column counts off oneDNN's 32-column blocks (zero padding), K from one tile to 48; the gate_up
matmul with SiLU-and-mul in its store against the matmul, F.silu and mul_; the check of oneDNN's layout failing on
bytes that are not the weight's; the layers and the MLP taking them up to AMX_MAX_ROWS rows and oneDNN above, with
the weights held once; and what they refuse. Skipped where the host or the build has no AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.kernels import cpu_native
from shardserve.worker.layers import cpu_packed
from shardserve.worker.layers.embedding import ParallelLMHead
from shardserve.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shardserve.worker.models.decoder import DecoderMLP, DecoderVariant
from tests.worker.test_cpu_packed import _filled, single_rank  # noqa: F401 (single_rank: the fixture, autouse there)

pytestmark = pytest.mark.skipif(not cpu_native.amx_available(), reason="no AMX here (or no C compiler)")


def _amx(w: torch.Tensor) -> cpu_native.AmxWeight | None:
    """w as the layers hold it on CPU (oneDNN's packed copy) and the AMX loop's view of that copy."""
    return cpu_native.amx_weight(cpu_packed.pack(w), w)


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The distance from each bfloat16 value to the next one away from zero (its last bit's weight)."""
    bits = x.view(torch.int16)
    return ((bits + 1).view(torch.bfloat16).float() - x.float()).abs()


def _assert_rounded_float32_sums(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ w^T summed in float32 and rounded to bfloat16: every entry within one step of the float32 sums'
    rounding (the sums' order differs), and nearly all equal to it."""
    expected = (x.float() @ w.float().t()).bfloat16()
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    off = (y.float() - expected.float()).abs()
    assert bool((off <= _bf16_step(expected)).all()), f"largest difference {off.max().item()}"
    assert (off == 0).float().mean().item() > 0.98


@pytest.mark.parametrize("rows", [1, 15, 32, 45, 96])
@pytest.mark.parametrize("k, n", [(32, 16), (576, 960), (1536, 576), (64, 40)])
def test_the_amx_matmul_gives_the_rounded_float32_sums(rows, k, n):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    amx = _amx(w)
    assert amx is not None and (amx.n, amx.k) == (n, k)
    _assert_rounded_float32_sums(cpu_native.linear_amx(x, amx), x, w)


def test_rows_apart_in_memory_are_read_at_their_stride():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(40, 96, generator=gen).bfloat16()
    x = wide[:, :64]  # rows 96 apart
    w = torch.randn(48, 64, generator=gen).bfloat16()
    _assert_rounded_float32_sums(cpu_native.linear_amx(x, _amx(w)), x, w)


def test_what_it_does_not_take():
    assert _amx(torch.randn(16, 48).bfloat16()) is None  # K not a multiple of 32
    assert _amx(torch.randn(16, 64)) is None  # float32
    w = torch.randn(16, 64).bfloat16()
    assert cpu_native.amx_weight(w, w) is None  # not oneDNN's packed tensor
    amx = _amx(w)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.linear_amx(torch.randn(4, 96).bfloat16(), amx)  # another K
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.linear_amx(torch.randn(4, 64), amx)  # float32 rows


@pytest.mark.parametrize("n", [64, 100])
def test_the_layout_check_refuses_bytes_that_are_not_the_weights(n):
    """amx_weight reads oneDNN's bytes back as the layout the loop expects: a value off anywhere (a whole block, the
    partial last one) and it gives None, so a layout oneDNN changes never reaches the loop."""
    w = torch.randn(n, 64).bfloat16()
    packed = cpu_packed.pack(w)
    assert cpu_native.amx_weight(packed, w) is not None
    for row, col in [(0, 0), (37, 63), (n - 1, 5)]:
        other = w.clone()
        other[row, col] += 1
        assert cpu_native.amx_weight(packed, other) is None, (row, col)
    assert cpu_native.amx_weight(packed, w.clone()) is not None  # the same values elsewhere: taken


def _assert_silu_and_mul_of(y: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor) -> None:
    """y is silu(gate) * up over the matmul's bfloat16 outputs, F.silu and mul_ rounding: nearly every entry the
    same bits, the rest a step of a bfloat16 apart (the matmul's sums, or SiLU's e^x, rounding the other way)."""
    gate, up = (x.float() @ gate_up.float().t()).bfloat16().chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    off = (y.float() - expected.float()).abs()
    assert y.shape == expected.shape
    assert bool((off <= 2 * _bf16_step(expected) + 1e-30).all()), f"largest difference {off.max().item()}"
    assert (off == 0).float().mean().item() > 0.995


@pytest.mark.parametrize("rows, k, n", [(1, 32, 32), (32, 576, 1536), (45, 96, 64), (7, 64, 96), (16, 64, 32)])
def test_silu_and_mul_in_the_matmuls_store(rows, k, n):
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    gate_up = (torch.randn(2 * n, k, generator=gen) * 0.3).bfloat16()
    _assert_silu_and_mul_of(cpu_native.linear_amx_silu_and_mul(x, _amx(gate_up)), x, gate_up)


def test_silu_and_mul_needs_the_gate_in_whole_blocks():
    gate_up = torch.randn(2 * 48, 64).bfloat16()  # 48 gate columns: the second block would hold up columns
    assert cpu_native.linear_amx_silu_and_mul(torch.randn(3, 64).bfloat16(), _amx(gate_up)) is None


def test_silu_far_below_and_above_zero():
    """Gates of +-200: SiLU's e^x neither overflows nor turns a large negative gate into a NaN."""
    x = torch.zeros(3, 32).bfloat16()
    x[:, 0] = torch.tensor([200.0, -200.0, 1.0])
    gate_up = torch.zeros(64, 32).bfloat16()
    gate_up[:32, 0] = 1.0  # every gate = x[:, 0]
    gate_up[32:, 0] = 0.5  # every up = x[:, 0] / 2
    y = cpu_native.linear_amx_silu_and_mul(x, _amx(gate_up))
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float()[:, 0], torch.tensor([20000.0, 0.0, 0.3655]), rtol=1e-2, atol=1e-3)


def test_layers_take_amx_up_to_its_rows_and_onednn_above():
    for layer in (_filled(MergedColumnParallelLinear(64, [40, 40]), torch.bfloat16),
                  _filled(RowParallelLinear(96, 64), torch.bfloat16)):
        plain = layer.weight.detach().clone()
        assert layer.pack_weights() and layer.weight_amx is not None
        assert layer.weight_amx.packed is layer.weight  # oneDNN's copy, read in place: the weight held once
        few = torch.randn(cpu_packed.AMX_MAX_ROWS, plain.shape[1]).bfloat16()
        _assert_rounded_float32_sums(layer(few), few, plain)
        many = torch.randn(cpu_packed.AMX_MAX_ROWS + 1, plain.shape[1]).bfloat16()
        assert torch.equal(layer(many), cpu_packed.linear(many, layer.weight))  # oneDNN's, bit for bit


def test_the_lm_head_takes_amx_with_its_vocabulary_padded():
    head = _filled(ParallelLMHead(100, 64), torch.bfloat16)
    assert head.pack_weights() and head.weight_amx is not None and head.weight_amx.packed is head.packed_weight
    hidden = torch.randn(7, 64).bfloat16()
    _assert_rounded_float32_sums(head(hidden), hidden, head.weight)


def test_the_mlp_takes_silu_and_mul_from_the_matmul_up_to_its_rows():
    config = type("Config", (), dict(hidden_size=64, intermediate_size=96, hidden_act="silu"))()
    variant = DecoderVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    mlp = _filled(DecoderMLP(config, variant), torch.bfloat16)
    gate_up, down = mlp.gate_up_proj.weight.detach().clone(), mlp.down_proj.weight.detach().clone()
    assert mlp.gate_up_proj.pack_weights() and mlp.down_proj.pack_weights()
    assert mlp.gate_up_proj.weight_amx.packed is mlp.gate_up_proj.weight  # one copy for both matmuls
    few = torch.randn(cpu_packed.AMX_MAX_ROWS, 64).bfloat16()
    _assert_silu_and_mul_of(mlp.gate_up_proj.silu_and_mul(few), few, gate_up)
    _assert_rounded_float32_sums(mlp(few), mlp.gate_up_proj.silu_and_mul(few), down)
    many = torch.randn(cpu_packed.AMX_MAX_ROWS + 1, 64).bfloat16()
    assert mlp.gate_up_proj.silu_and_mul(many) is None  # oneDNN's matmul, then SiluAndMul
    _assert_silu_and_mul_of(mlp.act(mlp.gate_up_proj(many)), many, gate_up)


def test_the_switch_off_leaves_onednn_alone(monkeypatch):
    monkeypatch.setattr(cpu_packed, "AMX", False)
    layer = _filled(RowParallelLinear(64, 32), torch.bfloat16)
    assert layer.pack_weights() and layer.weight_amx is None
