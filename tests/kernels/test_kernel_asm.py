"""The FP8 decode kernel as compiled for an H200 (sm_90), checked here without a GPU (bench/kernel_asm.py, in a
process of its own: the tests run Triton's interpreter, which compiles nothing): the "pairs" loop exists to move its
e4m3 tiles as the bf16 kernel moves its tiles."""

import json
import os
import subprocess
import sys


def ptx_counts(*args: str) -> dict[str, int]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-m", "shardserve.bench.kernel_asm", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["ptx"]


def test_the_pairs_decode_moves_fp8_tiles_in_16_byte_copies_with_no_byte_loads():
    ptx = ptx_counts("--cache", "fp8", "--variant", "pairs")
    assert ptx.get("cp.async.cg.shared.global", 0) >= 16  # K and V: 16-byte asynchronous copies into shared memory
    assert "cp.async.ca.shared.global" not in ptx  # (the e4m3 loops copy K in 8-byte pieces)
    assert not [op for op in ptx if op.startswith("ld.shared.b8")]  # (they read K back a byte at a time: 128 a tile)
    assert ptx.get("ldmatrix.sync.aligned.m8n8.x4.shared.b16", 0) > 0


def test_the_one_row_kernels_compile_for_sm90_with_their_launch_settings():
    """The one-row layer's GEMVs (programmatic dependent launch on), RoPE writing the cache and the decode kernel
    (launched as programmatic dependents as well, kernels/pdl.py) compile for an H200 at
    Llama-3-8B's shapes (the interpreter the other tests run checks less than the compiler: a loop variable that
    changes shape passed there and failed on the GPU). PDL GEMVs wait on the previous kernel (griddepcontrol); the
    FLAT GEMV keeps its weight tiles out of shared memory, where the reducing one passes each through it."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-m", "shardserve.bench.kernel_asm", "--one-row", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(kernels) == {"gemv_norm", "gemv_silu_residual", "gemv_norm_flat", "gemv_silu_residual_flat",
                            "gemv_fp8_norm_flat", "gemv_fp8_silu_residual_flat",
                            "rope_store_bf16", "rope_store_fp8", "rope_store_fp8_pdl", "decode_bf16_pdl"}
    for name, ptx in kernels.items():  # launch_dependents and wait where launched as a dependent, none elsewhere
        assert ptx["griddepcontrol"] == (2 if name.startswith("gemv") or name.endswith("_pdl") else 0), name
    assert kernels["rope_store_fp8"].get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0  # quantized on the way to the cache
    for reading in ("gemv_norm", "gemv_silu_residual"):
        assert kernels[reading]["st.shared.v4.b32"] >= 16  # the weight tiles through shared memory
        assert kernels[reading + "_flat"].get("st.shared.v4.b32", 0) <= 4  # only the final cross-lane sum
        # e4m3 weights: widened in registers, read 8 at a time in x's layout (no x tile through shared memory)
        fp8 = kernels[reading.replace("gemv", "gemv_fp8") + "_flat"]
        assert fp8.get("cvt.rn.f16x2.e4m3x2", 0) > 0 and fp8.get("st.shared.v4.b32", 0) <= 4, fp8
