"""The CPU path's native kernels in C: paged decode attention, the KV store, RoPE and RMSNorm (cpu_decode.c), and
bfloat16 matmuls of a decode step's few rows on AMX (cpu_amx.c).

The torch formulation of the in-place decode (torch_paged_decode.py) takes ~15 torch ops a layer, each a pass over
the step's scores, and reads every key row once per query head; the C kernel reads each key and value once per KV
head and keeps its sums in vector registers, so decode steps take markedly less time (docs/performance.md). It is
compiled here, not at install (kernels/cpu_build.py: for the host's own vector units, on torch's OpenMP runtime,
cached per source, compiler, flags, runtime and CPU). Where there is no compiler, the build fails, or ENABLED is
False (the tests of that fallback), `decode_kernel()` and `rms_norm()` are None and `store_kv()` and `rope_()`
False, and the torch ops run instead: the same bits for the store, RoPE and RMSNorm, the same attention within
float32 rounding, oneDNN's matmuls.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import platform
import shutil
import subprocess

import torch

from shardserve.kernels import cpu_build

log = logging.getLogger(__name__)

ENABLED = True  # False: the torch formulation only, as on a host without a compiler (the tests of that fallback)
_DTYPES = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}  # the decode kernel per dtype
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# the C functions and their arguments, in order (all return an int status)
_SIGNATURES = {
    # (q, k_t, v, tables, table_stride, lens, out, batch, heads, kv_heads, head_dim, block_size, num_blocks)
    **{name: [_P] * 4 + [_I64] + [_P] * 2 + [_I] * 5 + [_I64] for name in _DTYPES.values()},
    # (k, v, k_stride, v_stride, k_t, v_cache, slots, tokens, kv_heads, head_dim, block_size, elem_size, num_slots)
    "store_kv": [_P] * 2 + [_I64] * 2 + [_P] * 3 + [_I] * 5 + [_I64],
    # (x, x_stride, tokens, heads, head_dim, positions, cos, sin, max_position, elem_size)
    "rope_inplace": [_P, _I64] + [_I] * 3 + [_P] * 3 + [_I64, _I],
    # (x, x_stride, residual, r_stride, out, summed, weight, rows, n, eps, elem_size)
    "rms_norm_rows": [_P, _I64, _P, _I64] + [_P] * 3 + [_I] * 2 + [ctypes.c_float, _I],
    "amx_enable": [],
    # (x, ldx, m, k, w, n, y, ldy)
    "linear_bf16_amx": [_P] + [_I64] * 3 + [_P, _I64, _P, _I64],
    "linear_bf16_amx_silu": [_P] + [_I64] * 3 + [_P, _I64, _P, _I64],
}
_FALLBACK = "decode attention, the KV store, RoPE and RMSNorm run as torch ops, every matmul on oneDNN"

@functools.cache
def _library() -> ctypes.CDLL | None:
    if not ENABLED or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (%s) found: on the CPU %s, slower (docs/performance.md); install gcc for the C "
                    "kernels", os.environ.get("CC", "cc"), _FALLBACK)
        return None
    try:
        target = cpu_build.cached_object(compiler)
        lib = ctypes.CDLL(str(target))
        cpu_build.touch(target)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU C kernels did not build (%s): %s", detail, _FALLBACK)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def decode_kernel(dtype: torch.dtype, head_dim: int, block_size: int):
    """The C decode function for caches of this dtype and shape, or None where it does not apply or did not build."""
    if dtype not in _DTYPES or head_dim % 16 or block_size % 16:
        return None
    lib = _library()
    return None if lib is None else getattr(lib, _DTYPES[dtype])


def paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D] float32, one query per sequence. k_cache made by transposed_k_cache (logical
    [num_blocks, block_size, kv_heads, D], K^T within each block in memory), v_cache contiguous, both in the
    kernel's dtype; block_tables [B, >= blocks] and seq_lens [B] int32 (>= 1 each)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    k_mem = k_cache.permute(0, 2, 3, 1)
    if not (q.device.type == "cpu" and k_mem.is_contiguous() and v_cache.is_contiguous()
            and block_tables.dtype == torch.int32
            and seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1):
        raise ValueError("paged_decode: caches, tables or lengths not in the kernel's layout")
    query = (q.float() * scale).contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    rc = kernel(query.data_ptr(), k_mem.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                block_tables.stride(0), lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
                block_size, k_cache.shape[0])
    if rc != 0:
        raise RuntimeError(f"the CPU decode kernel refused its arguments ({rc}: a length < 1 or a block id outside "
                           "the cache)" if rc == -2 else f"the CPU decode kernel failed ({rc})")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """Writes k/v [T, kv_heads, D] at slots [T] (int64, each >= 0) into a transposed K cache and its V cache of
    the same dtype (float32 or bfloat16); False, with nothing written, where the C kernel does not take them."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_mem = k_cache.permute(0, 2, 3, 1)
    if not (k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dtype in _DTYPES
            and k_mem.is_contiguous()
            and v_cache.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
            and all(t.stride()[1:] == (head_dim, 1) for t in (k, v))):
        return False
    lib = _library()
    if lib is None:
        return False
    rc = lib.store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_mem.data_ptr(), v_cache.data_ptr(),
                      slots.data_ptr(), slots.numel(), num_kv_heads, head_dim, block_size, k.element_size(),
                      num_blocks * block_size)
    if rc != 0:
        raise RuntimeError(f"store_kv: a slot outside the cache ({rc})")
    return True


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> bool:
    """RoPE in place on x [T, heads, D] (float32 or bfloat16; heads and dims contiguous, any token stride), with
    cos/sin [max_position, D/2] float32 and positions [T] int64: bit for bit what RotaryEmbedding's torch ops
    compute. False, with nothing written, where the C kernel does not take them."""
    tokens, heads, head_dim = x.shape
    if not (x.device.type == "cpu" and x.dtype in _DTYPES and x.stride()[1:] == (head_dim, 1)
            and positions.dtype == torch.int64
            and positions.is_contiguous() and cos_cache.dtype == sin_cache.dtype == torch.float32
            and cos_cache.is_contiguous() and sin_cache.is_contiguous() and cos_cache.shape[1] * 2 == head_dim):
        return False
    lib = _library()
    if lib is None:
        return False
    rc = lib.rope_inplace(x.data_ptr(), x.stride(0), tokens, heads, head_dim, positions.data_ptr(),
                          cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0], x.element_size())
    if rc != 0:
        raise RuntimeError(f"rope_: a position outside the rotary tables ({rc})")
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x [T, n] (float32 or bfloat16, the weight's dtype), after adding residual where given: the
    normalised rows (and with a residual, the sum, the next residual), bit for bit what RMSNorm's torch ops give
    (HF's formula: the mean of squares in float32 summed in torch's order, then the weight in x's dtype). None where
    the C kernel does not take them, or where its sum order is not this torch's (`_sums_like_torch`)."""
    if not (x.device.type == "cpu" and x.dim() == 2 and x.dtype in _DTYPES and weight.dtype == x.dtype
            and x.stride(1) == 1
            and x.shape[1] % 16 == 0 and x.shape[1] <= 16384 and weight.is_contiguous()
            and weight.shape == (x.shape[1],)
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.stride(1) == 1))):
        return None
    lib = _library()
    if lib is None or not _sums_like_torch(x.dtype, x.shape[1], eps):
        return None
    return _rms_norm(lib.rms_norm_rows, x, weight, eps, residual)


def _rms_norm(kernel, x, weight, eps, residual):
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    rc = kernel(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                residual.stride(0) if residual is not None else 0, out.data_ptr(),
                summed.data_ptr() if summed is not None else None, weight.data_ptr(), x.shape[0], x.shape[1], eps,
                x.element_size())
    if rc != 0:
        raise RuntimeError(f"rms_norm: the C kernel failed ({rc})")
    return out if residual is None else (out, summed)


@functools.cache
def _sums_like_torch(dtype: torch.dtype, width: int, eps: float) -> bool:
    """Whether the C RMSNorm gives this torch's bits at this dtype and width, tried once: its sum of squares follows
    torch's CPU reduction order as torch 2.13 builds it on x86 (8-wide vectors), which another torch build or CPU may
    not; where it differs, RMSNorm stays on torch ops (a warning says so)."""
    agrees = _agrees_with_torch(_library().rms_norm_rows, dtype, width, eps)
    if not agrees:
        log.warning("the C RMSNorm does not give this torch's bits (%s, width %d): RMSNorm stays on torch ops",
                    dtype, width)
    return agrees


def _agrees_with_torch(kernel, dtype: torch.dtype, width: int, eps: float) -> bool:
    """kernel's RMSNorm (with a residual) against RMSNorm's torch ops (worker/layers/norm.py) on random rows."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(8, width, generator=gen) * torch.rand(8, 1, generator=gen) * 30).to(dtype)
    residual = torch.randn(8, width, generator=gen).to(dtype)
    weight = (torch.randn(width, generator=gen) * 0.5 + 1).to(dtype)
    normed, summed = _rms_norm(kernel, x, weight, eps, residual)
    reference = x + residual
    return torch.equal(summed, reference) and torch.equal(
        normed, weight * torch.rms_norm(reference, (width,), None, eps))


@functools.cache
def amx_available() -> bool:
    """Whether bfloat16 matmuls can run on AMX here: the object was built with AMX (the host has amx_tile and
    amx_bf16) and Linux granted this process AMX's register state (granted once, for the whole process)."""
    lib = _library()
    return lib is not None and lib.amx_enable() == 0


@dataclasses.dataclass(frozen=True, eq=False)
class AmxWeight:
    """A bfloat16 [n, k] weight as oneDNN packed it (worker/layers/cpu_packed.py), which the AMX loop reads in place:
    [n' / 32][k / 2][32][2] (cpu_amx.c). Holds the packed tensor, so its memory lives as long as this does."""

    packed: torch.Tensor  # layout torch._mkldnn
    address: int
    n: int
    k: int


def amx_weight(packed: torch.Tensor, weight: torch.Tensor) -> AmxWeight | None:
    """The AMX loop's view of oneDNN's packed copy of weight (bfloat16 [N, K], K a multiple of 32), once its bytes
    (a few blocks of them) are checked to be the layout cpu_amx.c reads (oneDNN picks its layout per CPU and version: where it picked
    another, None and oneDNN keeps every matmul); None without AMX or for another dtype or K."""
    if not (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and packed.is_mkldnn and packed.dtype == torch.bfloat16
            and packed.shape == weight.shape and amx_available()):
        return None
    n, k = weight.shape
    blocks = -(-n // 32)
    if torch.ops.mkldnn._nbytes(packed) != blocks * 32 * k * 2:
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    stored = torch.frombuffer((ctypes.c_int16 * (blocks * 32 * k)).from_address(address), dtype=torch.int16)
    stored = stored.view(blocks, k // 2, 32, 2)
    plain = weight.detach().view(torch.int16)
    full = n // 32
    # The layout is oneDNN's choice for the shape, not the values: the first, middle and last whole blocks (and the
    # partial one) show a different blocking or block order, at a few KiB a weight instead of a second pass over it.
    for b in sorted({0, full // 2, full - 1} if full else set()):
        if not torch.equal(stored[b], plain[b * 32:(b + 1) * 32].view(32, k // 2, 2).transpose(0, 1)):
            return None
    if n % 32 and not torch.equal(stored[-1, :, : n % 32].transpose(0, 1), plain[full * 32:].view(-1, k // 2, 2)):
        return None
    return AmxWeight(packed, address, n, k)


def linear_amx(x: torch.Tensor, weight: AmxWeight) -> torch.Tensor:
    """x [M, K] bfloat16 (rows contiguous) @ W^T -> [M, N] bfloat16 on AMX."""
    return _amx_matmul("linear_bf16_amx", x, weight, weight.n)


def linear_amx_silu_and_mul(x: torch.Tensor, weight: AmxWeight) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) -> [M, N] bfloat16 for a gate_up weight [gate; up] of 2 N rows, each step
    rounded to bfloat16 as the matmul, F.silu and mul_ round (SiLU's e^x a polynomial: its last bit may differ from
    torch's); None where N is not a multiple of 32 (the loop takes whole 32-column blocks of each)."""
    if weight.n % 64:
        return None
    return _amx_matmul("linear_bf16_amx_silu", x, weight, weight.n // 2)


def _amx_matmul(name: str, x: torch.Tensor, weight: AmxWeight, n: int) -> torch.Tensor:
    m, k = x.shape
    if not (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.stride(1) == 1 and k == weight.k):
        raise ValueError(f"{name}: x [{m}, {k}] {x.dtype} does not fit the weight [{weight.n}, {weight.k}]")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = getattr(_library(), name)(x.data_ptr(), x.stride(0), m, k, weight.address, n, out.data_ptr(), n)
    if rc != 0:
        raise RuntimeError(f"{name}: the C kernel failed ({rc})")
    return out
