"""The FP8 KV cache: quantization (torch reference and the Triton store, byte for byte), and the attention kernels
and backends reading an FP8 cache against the float32 reference over the dequantized cache. In the interpreter on
CPU; KV heads get magnitudes orders apart, so a scale applied to the wrong head shows."""

import pytest
import torch

from shardserve.kernels.kv_fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8, scales_from_amax
from shardserve.kernels.paged_decode import FP8_DECODE_VARIANTS, paged_decode_attention, paged_decode_attention_ref
from shardserve.kernels.prefill import paged_prefill_attention, paged_prefill_attention_ref
from shardserve.kernels.store_kv import store_kv
from shardserve.kernels.torch_backend import TorchAttentionBackend
from shardserve.kernels.torch_backend import store_kv as store_kv_ref
from shardserve.kernels.triton_backend import TritonAttentionBackend
from _paged_batch import every_e4m3_pair, make_batch  # tests/kernels is on sys.path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
HEAD_MAGNITUDES = (0.02, 1.0, 40.0, 300.0)  # per KV head: one head of Qwen2-like K bias past 448 unscaled


def fp8_batch(query_lens, seq_lens, *, num_heads, num_kv_heads, head_dim, block_size=8, dtype=torch.float32, seed=0):
    """make_batch with each KV head at its own magnitude, the caches quantized with scales calibrated on them."""
    q, k, v, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=torch.float32, device=DEVICE, seed=seed)
    mags = torch.tensor(HEAD_MAGNITUDES[:num_kv_heads], device=DEVICE)[:, None]
    k, v, k_cache, v_cache = (t * mags for t in (k, v, k_cache, v_cache))
    k_scale = scales_from_amax(k_cache.abs().amax(dim=(0, 1, 3)), 1.5)
    v_scale = scales_from_amax(v_cache.abs().amax(dim=(0, 1, 3)), 1.5)
    k8, v8 = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    return q.to(dtype), k.to(dtype), v.to(dtype), k8, v8, meta, k_scale, v_scale


def test_quantize_rounds_to_nearest_and_saturates():
    scale = torch.tensor([0.5])
    x = torch.tensor([[[3.9, -3.9, 7.8 / 2, 1000.0, -1000.0, 0.0, 1e-4]]])  # 3.9/0.5 = 7.8 -> 8 (a carry)
    got = dequantize_fp8(quantize_fp8(x, scale), scale, torch.float32)
    assert got[0, 0, :5].tolist() == [4.0, -4.0, 4.0, FP8_MAX * 0.5, -FP8_MAX * 0.5]
    assert got[0, 0, 5] == 0.0
    y = torch.randn(1000, 1, 16) * 10
    s = scales_from_amax(y.abs().amax(dim=(0, 2)), 1.0)
    err = (dequantize_fp8(quantize_fp8(y, s), s, torch.float32) - y).abs()
    assert (err <= y.abs() / 16 + s * 2**-9).all()  # half a step: 2^-4 relative, or the subnormal step


def test_store_kv_fp8_matches_the_torch_reference_byte_for_byte():
    num_blocks, block_size, heads, dim = 6, 4, 4, 16
    gen = torch.Generator().manual_seed(3)
    mags = torch.tensor(HEAD_MAGNITUDES)[:, None]
    k = (torch.randn(9, heads, dim, generator=gen) * mags).to(DEVICE)
    v = (torch.randn(9, heads, dim, generator=gen) * mags).to(DEVICE)
    k[0, 1, :4] = torch.tensor([7.8, -7.8, 7.75, 1e6])  # with scale 1: a carry to 8, a tie (to even: 8), saturation
    slots = torch.tensor([0, 5, 22, -1, 7, 8, 3, 23, 12], device=DEVICE)
    k_scale = torch.tensor([0.02, 1.0, 0.5, 2.0], device=DEVICE)
    v_scale = torch.tensor([0.01, 0.3, 0.1, 1.5], device=DEVICE)
    caches = [torch.zeros(num_blocks, block_size, heads, dim, device=DEVICE).to(FP8_DTYPE) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    store_kv_ref(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].view(-1, heads, dim)[0, 1, :4].float().tolist() == [8.0, -8.0, 8.0, FP8_MAX]
    assert not caches[0].view(torch.uint8).view(-1, heads, dim)[[1, 2, 4]].any()  # slots nobody wrote stay zero


@pytest.mark.parametrize("variant", FP8_DECODE_VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_reads_the_fp8_cache_with_each_heads_scales(dtype, num_splits, variant):
    q, _, _, k8, v8, meta, ks, vs = fp8_batch([1, 1, 1], [1, 17, 150], num_heads=8, num_kv_heads=4, head_dim=32,
                                              dtype=dtype, seed=1)
    out = paged_decode_attention(q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                 k_scale=ks, v_scale=vs, fp8_variant=variant)
    ref = paged_decode_attention_ref(q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, ks, vs)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    bound = tol * 300 + tol * ref.float().abs()
    assert ((out.float() - ref.float()).abs() <= bound).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_over_blocks_of_whole_tiles_reads_the_right_keys(num_splits):
    """128-token blocks: each of the FP8 loop's 128-key tiles lies in one block."""
    q, _, _, k8, v8, meta, ks, vs = fp8_batch([1, 1, 1], [1, 200, 513], num_heads=8, num_kv_heads=4, head_dim=32,
                                              block_size=128, seed=2)
    out = paged_decode_attention(q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                 k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, ks, vs)
    assert ((out.float() - ref.float()).abs() <= 1e-4 * 300 + 1e-4 * ref.float().abs()).all()


def test_decode_and_prefill_refuse_an_fp8_cache_without_scales():
    q, _, _, k8, v8, meta, ks, _ = fp8_batch([1], [5], num_heads=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="v_scale"):
        paged_decode_attention(q, k8, v8, meta.block_tables, meta.seq_lens, SCALE, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale"):
        paged_prefill_attention(q, k8, v8, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_extend_and_decode_read_the_fp8_cache(dtype):
    q, _, _, k8, v8, meta, ks, vs = fp8_batch([7, 13, 1], [40, 13, 30], num_heads=6, num_kv_heads=3, head_dim=32,
                                              dtype=dtype, seed=2)
    args = (q, k8, v8, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE)
    out = paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention_ref(*args, k_scale=ks, v_scale=vs)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 300, rtol=tol)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1, 1], [3, 40, 9, 33]), ([5, 1, 12], [21, 30, 12])])
def test_backends_store_then_attend_over_an_fp8_cache_alike(query_lens, seq_lens):
    """The whole backend step (quantize the new K/V into the cache, attend) on torch and on Triton, and both
    against the float32 reference over the dequantized cache."""
    q, k, v, k8, v8, meta, ks, vs = fp8_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=4, head_dim=16, seed=4)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kc, vc = k8.clone(), v8.clone()
        results.append((backend.forward(q, k, v, kc, vc, meta, SCALE, ks, vs), kc, vc))
    (torch_out, kc, vc), (triton_out, kc2, vc2) = results
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8)) and torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    ref = paged_prefill_attention_ref(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE, ks, vs)
    torch.testing.assert_close(torch_out, ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(triton_out, ref, atol=1e-3, rtol=1e-4)


def test_decode_launch_settings_per_cache():
    from shardserve.kernels.paged_decode import DEEP_MAX_PROGRAMS, decode_launch

    assert decode_launch(True, 128, 1, 512)[0] == 2 * decode_launch(False, 128, 1, 512)[0]  # a bf16 tile's bytes
    assert decode_launch(True, 256, 1, 512)[0] == decode_launch(True, 128, 1, 512)[0] // 2  # larger heads: half
    # bf16, a whole context a program in a launch of at most DEEP_MAX_PROGRAMS: a third stage; else two
    assert decode_launch(False, 128, 1, DEEP_MAX_PROGRAMS)[2] == 3
    assert decode_launch(False, 128, 1, DEEP_MAX_PROGRAMS + 8)[2] == decode_launch(False, 128, 4, 512)[2] == 2
    assert decode_launch(True, 128, 1, 512)[2] == decode_launch(True, 128, 4, 512)[2] == 2


def test_pairs_widening_gives_every_e4m3_value_exactly():
    """The "pairs" decode loop's widening (the interpreter's bit moves here; the GPU suite checks the inline PTX):
    each int16's low byte becomes the even output, its high byte the odd one, both equal to e4m3 -> fp16."""
    from shardserve.kernels.fp8_pairs import widen_pairs

    x, ok = every_e4m3_pair()
    even, odd = widen_pairs(x.to(DEVICE))
    want = x.view(torch.uint8).view(FP8_DTYPE).to(torch.float16).view(-1, 2)
    assert torch.equal(even.cpu()[ok].view(torch.int16), want[ok, 0].view(torch.int16))  # bitwise: -0.0 too
    assert torch.equal(odd.cpu()[ok].view(torch.int16), want[ok, 1].view(torch.int16))
