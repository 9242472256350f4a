"""The CPU decode kernel in C (kernels/cpu_decode.c, built by kernels/cpu_native.py) against softmax(q k^T) v in
float64 over scattered blocks: float32 and bfloat16 caches, query groups of 1 to 8 heads (more than the four a pass
takes), head sizes of one to eight 16-float vectors, blocks of 16 and 32, contexts of one token, partial and whole
last blocks; scores far apart (the softmax's maximum) and far below it (e^x's underflow); the torch backend taking it
for decode-only and mixed batches; and the fallbacks: shapes it does not take, no compiler, the switch off."""

from __future__ import annotations

import ctypes
import logging
import os
import time

import pytest
import torch

from shardserve.kernels import cpu_build, cpu_native
from shardserve.kernels.torch_backend import TorchAttentionBackend
from shardserve.kernels.torch_paged_decode import build_decode_index, paged_decode
from tests.kernels._paged_batch import make_batch
from tests.kernels.test_torch_paged_decode import gathered_reference, transposed

pytestmark = pytest.mark.skipif(cpu_native.decode_kernel(torch.float32, 64, 16) is None,
                                reason="no C compiler here: the torch formulation runs instead")


@pytest.fixture
def fresh_library():
    """_library() looked up again under the test's environment, and again after it."""
    cpu_native._library.cache_clear()
    yield
    cpu_native._library.cache_clear()


def run_kernel(q, k_cache, v_cache, meta, scale):
    kernel = cpu_native.decode_kernel(k_cache.dtype, q.shape[2], k_cache.shape[1])
    assert kernel is not None
    return cpu_native.paged_decode(kernel, q, transposed(k_cache), v_cache, meta.block_tables, meta.seq_lens, scale)


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size",
    [
        ([1, 16, 17, 33, 5, 64, 100, 2], 9, 3, 64, 16),  # the default model's shape: one token, whole and partial
        ([250, 3, 129], 4, 4, 16, 16),  # plain multi-head, one vector a head
        ([40, 95], 8, 1, 128, 32),  # multi-query, 8 heads a group (two passes of 4), 8 vectors a head (two of 4)
        ([31, 64, 1], 10, 2, 80, 16),  # groups of 5 (a pass of 4, then 1), 5 vectors a head (4, then 1)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_equals_float64_attention(seq_lens, heads, kv_heads, head_dim, block_size, dtype):
    q, _, _, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, num_heads=heads,
                                                 num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                                                 dtype=dtype, seed=len(seq_lens) + heads)
    scale = head_dim**-0.5
    out = run_kernel(q, k_cache, v_cache, meta, scale)
    # the reference from the same (rounded) inputs: the kernel computes in float32 from there
    expected = gathered_reference(q.double(), k_cache.double(), v_cache.double(), meta, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_scores_far_apart_and_far_below_the_maximum():
    """Sharp attention: scores spread over hundreds (most numerators underflow e^-87 to 0, one dominates), and a
    second sequence whose scores are all equal (the plain mean of its values)."""
    q, _, _, k_cache, v_cache, meta = make_batch([1, 1], [70, 37], num_heads=6, num_kv_heads=2, head_dim=32,
                                                 block_size=16, dtype=torch.float32, seed=3)
    q[0] *= 60.0
    q[1] = 0.0
    out = run_kernel(q, k_cache, v_cache, meta, 1.0)
    expected = gathered_reference(q.double(), k_cache.double(), v_cache.double(), meta, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_it_agrees_with_the_torch_formulation_it_replaces():
    q, _, _, k_cache, v_cache, meta = make_batch([1] * 5, [300, 1, 47, 128, 9], num_heads=9, num_kv_heads=3,
                                                 head_dim=64, block_size=16, dtype=torch.bfloat16, seed=7)
    kt = transposed(k_cache)
    index = build_decode_index(meta.block_tables, meta.seq_lens_cpu, 16, 9, 3, 64)
    torch_out = paged_decode(q, kt, v_cache, index, 0.125).float()
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, meta, 0.125), torch_out, atol=2e-2, rtol=2e-2)


def test_the_backend_takes_it_for_decodes_alone_and_beside_prefills(monkeypatch):
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    query_lens, seq_lens = [1, 5, 1, 12, 1], [30, 20, 3, 12, 17]
    q, _, _, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=16, dtype=torch.float32, seed=5)
    out = TorchAttentionBackend().attend(q, transposed(k_cache), v_cache, meta, scale=0.25)
    usual = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale=0.25)  # K not transposed: torch ops
    rows, decodes = [0, 6, 19], [0, 2, 4]
    torch.testing.assert_close(out[rows], gathered_reference(q[rows], k_cache, v_cache, meta, 0.25, seqs=decodes),
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, usual, atol=2e-5, rtol=2e-5)
    q2, _, _, k2, v2, meta2 = make_batch([1] * 3, [5, 40, 16], num_heads=4, num_kv_heads=2, head_dim=16,
                                         block_size=16, dtype=torch.float32, seed=6)
    out2 = TorchAttentionBackend().attend(q2, transposed(k2), v2, meta2, scale=0.25)
    torch.testing.assert_close(out2, gathered_reference(q2, k2, v2, meta2, 0.25), atol=2e-5, rtol=2e-5)
    assert calls == [3, 3]  # the mixed batch's three decodes, then the decode-only batch


def test_shapes_and_dtypes_it_does_not_take_fall_back():
    assert cpu_native.decode_kernel(torch.float16, 64, 16) is None
    assert cpu_native.decode_kernel(torch.float32, 24, 16) is None  # head size not a multiple of 16
    assert cpu_native.decode_kernel(torch.bfloat16, 64, 8) is None  # block size not a multiple of 16
    q, _, _, k_cache, v_cache, meta = make_batch([1, 1], [9, 30], num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=8, dtype=torch.float32, seed=8)
    out = TorchAttentionBackend().attend(q, transposed(k_cache), v_cache, meta, scale=0.25)  # the torch formulation
    torch.testing.assert_close(out, gathered_reference(q, k_cache, v_cache, meta, 0.25), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="layout"):  # K not transposed: refused, not read wrongly
        cpu_native.paged_decode(cpu_native.decode_kernel(torch.float32, 16, 16), q, k_cache, v_cache,
                                meta.block_tables, meta.seq_lens, 0.25)


def test_without_a_compiler_or_with_the_switch_off_there_is_no_kernel(fresh_library, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.decode_kernel(torch.float32, 64, 16) is None
    assert "no C compiler" in caplog.text and "no-such-compiler" in caplog.text
    caplog.clear()
    cpu_native._library.cache_clear()
    false_compiler = tmp_path / "cc"
    false_compiler.write_text("#!/bin/sh\necho 'cc: broken on purpose' >&2\nexit 1\n")
    false_compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(false_compiler))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.decode_kernel(torch.float32, 64, 16) is None
    assert "broken on purpose" in caplog.text
    assert not list((tmp_path / "shardserve" / "native").glob("*"))  # no half-written object left behind
    cpu_native._library.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setattr(cpu_native, "ENABLED", False)
    assert cpu_native.decode_kernel(torch.float32, 64, 16) is None


def test_the_object_is_built_once_per_source_and_cpu_into_the_cache_dir(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_native.decode_kernel(torch.bfloat16, 64, 16) is not None
    built = list((tmp_path / "shardserve" / "native").glob("cpu_decode-*.so"))
    assert len(built) == 1
    inode = built[0].stat().st_ino
    cpu_native._library.cache_clear()
    assert cpu_native.decode_kernel(torch.float32, 32, 32) is not None
    built_now = [p.stat().st_ino for p in (tmp_path / "shardserve" / "native").glob("*")]
    assert built_now == [inode]  # reused, not rebuilt (a build renames a new file into place)


def test_a_build_removes_objects_unused_for_a_month_and_a_dead_builds_leftovers(fresh_library, monkeypatch,
                                                                                tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "shardserve" / "native"
    cache.mkdir(parents=True)
    day = 86400
    ages = {"cpu_decode-0123456789abcdef.so": 31 * day,  # another source's object, last loaded a month ago: goes
            "cpu_decode-fedcba9876543210.so": 29 * day,  # loaded within the month (another venv, say): stays
            "cpu_decode-0123456789abcdefk1x2.tmp": 2 * day,  # a build that died two days ago: goes
            "cpu_decode-0123456789abcdefk3x4.tmp.0.o": 2 * day,
            "cpu_decode-fedcba9876543210q5w6.tmp": 600,  # a build running beside this one: stays
            "notes.txt": 90 * day}  # not the cache's: stays
    now = time.time()
    for name, age in ages.items():
        (cache / name).write_bytes(b"x")
        os.utime(cache / name, (now - age, now - age))
    assert cpu_native.decode_kernel(torch.float32, 64, 16) is not None
    left = {p.name for p in cache.iterdir()}
    built = {name for name in left if name not in ages}
    assert len(built) == 1 and built.pop().endswith(".so")
    assert left & set(ages) == {"cpu_decode-fedcba9876543210.so", "cpu_decode-fedcba9876543210q5w6.tmp", "notes.txt"}


def test_loading_a_cached_object_marks_it_used(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_native.decode_kernel(torch.float32, 64, 16) is not None
    (built,) = (tmp_path / "shardserve" / "native").glob("cpu_decode-*.so")
    month_ago = time.time() - 30 * 86400
    os.utime(built, (month_ago, month_ago))
    cpu_native._library.cache_clear()
    assert cpu_native.decode_kernel(torch.float32, 64, 16) is not None
    assert time.time() - built.stat().st_mtime < 3600


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_store_writes_what_the_torch_store_writes(dtype):
    """New K/V rows (views into a wider projection output, as the QKV split gives them) at scattered slots: the C
    store against index_put_/index_copy_ through the same transposed cache; the rest of the cache untouched."""
    from shardserve.kernels.torch_paged_decode import transposed_k_cache

    gen = torch.Generator().manual_seed(4)
    tokens, kv_heads, head_dim, block_size, num_blocks = 70, 3, 24, 16, 9  # 70 tokens: the parallel loop too
    qkv = torch.randn(tokens, 5 * kv_heads * head_dim, generator=gen).to(dtype)
    k = qkv[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 3 * kv_heads * head_dim: 4 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = []
    for use_c in (True, False):
        k_cache = transposed_k_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
        v_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        k_cache.copy_(torch.full_like(k_cache, 1000.0))  # randn never writes this
        if use_c:
            assert cpu_native.store_kv(k, v, k_cache, v_cache, slots)
        else:
            k_cache.index_put_((slots // block_size, slots % block_size), k)
            v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert (caches[0][0] == 1000.0).sum() == (num_blocks * block_size - tokens) * kv_heads * head_dim


def test_the_c_store_refuses_a_slot_outside_the_cache_and_writes_nothing():
    from shardserve.kernels.torch_paged_decode import transposed_k_cache

    k_cache = transposed_k_cache(2, 16, 1, 16, torch.float32)
    v_cache = torch.zeros(2, 16, 1, 16)
    k, v = torch.ones(2, 1, 16), torch.ones(2, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_native.store_kv(k, v, k_cache, v_cache, torch.tensor([3, 32]))
    assert not k_cache.any() and not v_cache.any()
    assert not cpu_native.store_kv(k.half(), v.half(), k_cache.half(), v_cache.half(), torch.tensor([3, 4]))


def test_a_block_id_outside_the_cache_is_refused_before_anything_is_read():
    q, _, _, k_cache, v_cache, meta = make_batch([1, 1], [20, 33], num_heads=2, num_kv_heads=1, head_dim=16,
                                                 block_size=16, dtype=torch.float32, seed=9)
    meta.block_tables[1, 2] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id outside"):
        run_kernel(q, k_cache, v_cache, meta, 0.25)


def test_the_kernel_runs_on_the_openmp_runtime_torch_loaded(fresh_library, monkeypatch, tmp_path):
    """Built anew here, the object loads no second OpenMP runtime: the set of libgomp/libiomp5 files mapped into the
    process is the same before and after (a second one would keep its own threads spinning beside torch's)."""
    def runtimes() -> set[str]:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if "libgomp" in line or "libiomp5" in line}

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = runtimes()
    assert cpu_build.openmp_runtime() in before
    assert cpu_native.decode_kernel(torch.float32, 64, 16) is not None
    assert list((tmp_path / "shardserve" / "native").glob("*.so"))
    assert runtimes() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 70])  # 70: the parallel loop too
def test_the_c_rope_gives_the_torch_ops_bits(dtype, tokens):
    """In place on the q and k heads of a QKV output (a strided view), large values and late positions included:
    the same bits as RotaryEmbedding's torch ops (each product and sum rounded on its own, then the dtype)."""
    from shardserve.worker.layers.rotary import RotaryEmbedding, _rotated_halves

    rotary = RotaryEmbedding(64, 4096, 1e5)
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, 15 * 64, generator=gen) * 50).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    positions[0] = 4095
    heads = qkv[:, : 12 * 64].view(tokens, 12, 64)
    first, second = _rotated_halves(heads, *rotary._cos_sin(positions))
    expected = qkv.clone()
    expected[:, : 12 * 64].view(tokens, 12, 64).copy_(torch.cat([first, second], dim=-1))
    assert cpu_native.rope_(heads, positions, rotary.cos_cache, rotary.sin_cache)
    assert torch.equal(qkv, expected)  # the v heads after them untouched too


def test_the_c_rope_refuses_a_position_past_its_tables_and_leaves_other_dtypes_to_torch():
    from shardserve.worker.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(32, 128, 1e4)
    x = torch.ones(3, 2, 32)
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        cpu_native.rope_(x, torch.tensor([0, 5, 128]), rotary.cos_cache, rotary.sin_cache)
    assert torch.equal(x, torch.ones(3, 2, 32))
    assert not cpu_native.rope_(x.half(), torch.tensor([0, 5, 6]), rotary.cos_cache, rotary.sin_cache)
    assert not cpu_native.rope_(x, torch.tensor([0, 5, 6], dtype=torch.int32), rotary.cos_cache, rotary.sin_cache)


def test_a_cache_dir_that_cannot_be_written_leaves_the_torch_ops(fresh_library, monkeypatch, tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))  # mkdir under a plain file fails
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.decode_kernel(torch.float32, 64, 16) is None
    assert "did not build" in caplog.text
    q, _, _, k_cache, v_cache, meta = make_batch([1, 1], [9, 30], num_heads=4, num_kv_heads=2, head_dim=16,
                                                 block_size=16, dtype=torch.float32, seed=10)
    out = TorchAttentionBackend().attend(q, transposed(k_cache), v_cache, meta, scale=0.25)
    torch.testing.assert_close(out, gathered_reference(q, k_cache, v_cache, meta, 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [16, 112, 576, 960, 4096])
@pytest.mark.parametrize("rows", [1, 33, 130])  # 130 x 4096: the parallel loop too
def test_the_c_rms_norm_gives_the_torch_ops_bits(dtype, hidden, rows):
    """With and without the residual add, rows of very different scales: the same bits as RMSNorm's torch ops (HF's
    formula; the mean of squares summed in torch's own order)."""
    from shardserve.worker.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 30).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    if not cpu_native._sums_like_torch(dtype, hidden, norm.eps):  # (a torch build that sums in another order)
        pytest.skip("this torch's CPU sum order is not the C kernel's: RMSNorm stays on torch ops here")
    assert torch.equal(cpu_native.rms_norm(x, norm.weight, norm.eps), norm._norm(x))
    normed, summed = cpu_native.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm._norm(x + residual))


def test_a_c_rms_norm_that_does_not_sum_like_torch_is_not_used(caplog, monkeypatch):
    """The first use at a dtype and width compares the kernel with torch's ops on random rows: a kernel whose bits
    differ (here the real one with its output nudged by an ulp) is refused, with a warning."""
    real = cpu_native._library().rms_norm_rows

    def nudged(x, x_stride, residual, r_stride, out, summed, weight, rows, n, eps, elem_size):
        rc = real(x, x_stride, residual, r_stride, out, summed, weight, rows, n, eps, elem_size)
        ctypes.c_uint32.from_address(out).value += 1  # the first output's float32 bits, one ulp on
        return rc

    assert not cpu_native._agrees_with_torch(nudged, torch.float32, 64, 1e-6)
    assert cpu_native._agrees_with_torch(real, torch.float32, 64, 1e-6)
    cpu_native._sums_like_torch.cache_clear()
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        monkeypatch.setattr(cpu_native, "_agrees_with_torch", lambda *a: False)
        assert cpu_native.rms_norm(torch.ones(2, 64), torch.ones(64), 1e-6) is None  # torch's ops then
    cpu_native._sums_like_torch.cache_clear()
    assert "does not give this torch's bits" in caplog.text
    monkeypatch.undo()
    assert cpu_native._sums_like_torch(torch.float32, 64, 1e-6)
    assert cpu_native._sums_like_torch(torch.bfloat16, 576, 1e-5)


def test_the_c_rms_norm_leaves_what_it_does_not_take_to_torch():
    weight = torch.ones(24)
    assert cpu_native.rms_norm(torch.ones(2, 24), weight, 1e-6) is None  # width not a multiple of 16
    assert cpu_native.rms_norm(torch.ones(2, 32).half(), torch.ones(32).half(), 1e-6) is None
    assert cpu_native.rms_norm(torch.ones(2, 32), torch.ones(32).bfloat16(), 1e-6) is None  # weight's dtype


def test_tensors_off_the_cpu_are_left_to_the_callers_torch_ops():
    """The wrappers themselves refuse tensors on another device (here "meta": no memory to point at), so the layers
    call them on any device and keep their torch path for the rest."""
    from shardserve.worker.layers.rotary import RotaryEmbedding

    meta = torch.device("meta")
    assert cpu_native.rms_norm(torch.empty(2, 64, device=meta), torch.empty(64, device=meta), 1e-6) is None
    rotary = RotaryEmbedding(64, 16, 1e4)
    assert not cpu_native.rope_(torch.empty(2, 3, 64, device=meta), torch.zeros(2, dtype=torch.long, device=meta),
                                rotary.cos_cache, rotary.sin_cache)
    k_cache = torch.empty(4, 3, 64, 16, device=meta).permute(0, 3, 1, 2)  # the transposed layout's shape
    v_cache = torch.empty(4, 16, 3, 64, device=meta)
    assert not cpu_native.store_kv(torch.empty(2, 3, 64, device=meta), torch.empty(2, 3, 64, device=meta), k_cache,
                                   v_cache, torch.zeros(2, dtype=torch.long, device=meta))
