"""Triton sampling: one pass over each row's logits, no softmax, no sort, no cumulative sum.

The Gumbel-max trick: argmax_i(logit_i / T + g_i), with g_i = -log(-log(u_i)) and u_i uniform in (0, 1), picks
token i with probability softmax(logit / T)_i. Each u_i is a hash of (the row's 64-bit key, i), so a row's token
is a pure function of its logits and its key (worker/sampling_keys.row_key(seed, index of the generated token)): the
same on every tensor-parallel rank, whatever the batch around it. Masked tokens (-inf logits, from min_tokens or
penalties) are never picked, nor, when a row has a threshold (kernels/sampling_filter.py: top-k, top-p, min-p as
one cut-off), the tokens with logit / T below it.

The hash: two rounds of murmur3's 32-bit finaliser, over the token index xor each half of the key, in uint32
arithmetic (each multiply wraps modulo 2^32: the same bits as the int64 reference's multiply and mask). Its top 24
bits m give u = (m + 0.5) / 2^24 in (0, 1), the exponential draw E = -ln(u) and the noise g = -ln(E). E comes from
w = 1 - u = (2^24 - 1 - m + 0.5) / 2^24, which float32 holds exactly where it is small: there (w < 1/4) E = -ln(1 -
w) by its series, elsewhere from log2(u). The largest noise, which decides most draws, comes from the smallest w,
so that end must be exact. (Computed as 1 - u in float32, the top m gave u = 1.0, since m + 0.5 rounds up to 2^24,
then E = 0 and infinite noise: at Qwen3's 151,936 entries ~0.9% of rows drew that token whatever its
probability.) Compiled, both logs are the GPU's approximate log2 (one instruction each, absolute error ~2^-22,
where libdevice's logf took ~20 instructions), which leaves the noise within ~1e-6 of the exact one;
interpreted, torch's log2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.fp8_pairs import COMPILED

_BLOCK = 2048
_LN2 = tl.constexpr(0.6931471805599453)
_PROGRAMS_PER_SM = 8  # the draw's programs: about this many per SM (a row's vocabulary split over several)


@triton.jit
def _fmix32(h):  # h: uint32
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _log2(x, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)


@triton.jit
def _gumbel_noise(h, ASM: tl.constexpr):
    """-ln(E), E = -ln(u), from a uint32 hash h (the module's docstring); float32."""
    m = h >> 8
    u = (m.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    w = ((16777215 - m).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    # -ln(1 - w) = w + w^2/2 + ... + w^10/10: under 1e-7 relative left out for w < 1/4
    series = 0.1
    for k in tl.static_range(9, 0, -1):
        series = 1.0 / k + w * series
    e = tl.where(w < 0.25, w * series, -_LN2 * _log2(u, ASM))
    return -_LN2 * _log2(e, ASM)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, keys_ptr, inv_temps_ptr, thresholds_ptr, best_ptr, index_ptr, vocab,
                          chunk, BLOCK: tl.constexpr, HAS_THRESHOLD: tl.constexpr, ASM: tl.constexpr = False):
    """Grid (rows, chunks). Program (r, c) scans vocabulary entries [c * chunk, (c + 1) * chunk) of row r and
    writes its best score and index to best[r, c], index[r, c]. keys: [rows, 2] int64 (low, high 32 bits).
    HAS_THRESHOLD: only tokens with logit * inv_temp >= thresholds[r] compete."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    inv_t = tl.load(inv_temps_ptr + row)
    if HAS_THRESHOLD:
        threshold = tl.load(thresholds_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hi
        logit = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        h = _fmix32(_fmix32(cols.to(tl.uint32) ^ k0) ^ k1)
        score = logit * inv_t + _gumbel_noise(h, ASM)
        keep = mask & (logit > float("-inf"))
        if HAS_THRESHOLD:
            keep = keep & (logit * inv_t >= threshold)
        score = tl.where(keep, score, float("-inf"))
        better = score > best  # per lane: ties keep the lower index (seen first)
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, 0)
    # the lowest index among lanes holding the maximum (a part of all -inf reports its first index)
    winner = tl.min(tl.where(best == top, best_idx, hi), 0)
    tl.store(best_ptr + row * num_parts + part, top)
    tl.store(index_ptr + row * num_parts + part, tl.minimum(winner, tl.maximum(hi - 1, lo)).to(tl.int64))


def split_keys(keys: list[int]) -> list[int]:
    """[k0 low, k0 high, k1 low, ...]: each 64-bit key as two 32-bit halves (the kernel's key layout)."""
    out = []
    for key in keys:
        out.append(key & 0xFFFFFFFF)
        out.append((key >> 32) & 0xFFFFFFFF)
    return out


def gumbel_sample(logits: torch.Tensor, keys: torch.Tensor, inv_temps: torch.Tensor,
                  thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, V] (float32/bf16; -inf = excluded), keys [n, 2] int64 (split_keys), inv_temps [n] float32
    (1 / temperature), thresholds [n] float32 or None (a row draws among the tokens with logit * inv_temp >= its
    threshold) -> [n] int64 token ids."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    # Split each row's vocabulary over several programs (one program scanning 152k entries alone takes ~0.1 ms),
    # about _PROGRAMS_PER_SM per SM in all, then pick the best part. The winner does not depend on the split: the
    # best score, ties to the lowest index.
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 4
    parts = max(1, min(64, triton.cdiv(_PROGRAMS_PER_SM * sms, n), triton.cdiv(vocab, _BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), _BLOCK) * _BLOCK
    parts = triton.cdiv(vocab, chunk)
    best = torch.empty(n, parts, dtype=torch.float32, device=logits.device)
    index = torch.empty(n, parts, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(n, parts)](logits, logits.stride(0), keys, inv_temps,
                                      inv_temps if thresholds is None else thresholds, best, index, vocab, chunk,
                                      BLOCK=_BLOCK, HAS_THRESHOLD=thresholds is not None, ASM=COMPILED)
    if parts == 1:
        return index.view(n)
    return index.gather(1, best.argmax(dim=1, keepdim=True)).view(n)


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def gumbel_sample_ref(logits: torch.Tensor, keys: torch.Tensor, inv_temps: torch.Tensor,
                      thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """The same draw in torch (int64 hashing, the noise in float64): the reference the kernel is tested against."""
    n, vocab = logits.shape
    cols = torch.arange(vocab, dtype=torch.int64, device=logits.device).unsqueeze(0)
    h = _fmix32_ref(_fmix32_ref(cols ^ keys[:, :1]) ^ keys[:, 1:])
    w = ((16777215 - (h >> 8)).to(torch.float64) + 0.5) / 16777216.0  # 1 - u, exact
    noise = -torch.log(-torch.log1p(-w))  # float64, rounded once
    score = logits.float() * inv_temps.unsqueeze(1) + noise.to(torch.float32)
    keep = logits.float() > float("-inf")
    if thresholds is not None:
        keep &= logits.float() * inv_temps.unsqueeze(1) >= thresholds.unsqueeze(1)
    score = torch.where(keep, score, float("-inf"))
    return score.argmax(dim=1)
