"""Top-k, top-p and min-p as one cut-off value per row, found without a sort.

What a row keeps: with x = logit / T (float32), the tokens with x >= threshold. The threshold is the largest of
- top-k: the k-th largest x (the largest value v with count(x >= v) >= k);
- top-p: the largest value v with mass(x >= v) >= p * mass(x >= top-k threshold), mass(S) = sum over S of
  exp(x - max x): the smallest set of best tokens holding p of the (top-k) probability, as the sorted cumulative
  sum finds it;
- min-p: max x + log(min_p) (p_i >= min_p * p_max).
Ties at a cut-off are all kept: every token whose x equals the threshold stays (a sort keeps an arbitrary subset of
tied tokens, the first in its order). The result is exact up to the float32 sums: the masses are summed in another
order than a sorted cumulative sum, so a token whose cumulative mass is within float rounding of p may fall on the
other side; counts (top-k) are exact.

The search (one program per row, every pass a read of the row): pass 1 takes the row's max, min and number of
finite entries. Then each search keeps lo (a value whose F(lo) = count or mass of x >= lo reaches the target) and hi
(one whose F does not); a pass evaluates F at K evenly spaced pivots in (lo, hi), and the smallest and largest x in
[lo, hi). The interval shrinks K + 1 times a pass, and the search ends when [lo, hi) holds a single distinct value:
that value is the threshold. bf16 logits take a few passes (few distinct values), float32 ones five or six. Sums
are per-program reductions in a fixed order (no atomics), so every tensor-parallel rank computes the same bits.

`filter_thresholds_ref` computes the same thresholds in torch with a sort: the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 512
_PIVOTS = 16  # pivots per pass: the interval shrinks 17 times a pass
_MAX_PASSES = 48  # a bound only: float32 ranges end within ~12 passes; if reached, lo (a superset) is kept


@triton.jit
def _scaled(row_ptr, cols, vocab, inv_t):
    """x = logit * (1 / T) as float32; -inf past the row's end (the same product the Gumbel kernel compares)."""
    logit = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    return logit * inv_t


@triton.jit
def _search(row_ptr, vocab, inv_t, top, lo, hi, goal, MASS: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
            MAX_PASSES: tl.constexpr):
    """The largest x value v with F(v) >= target, given F(lo) >= target > F(hi). F(t): the number (MASS False) or
    the mass exp(x - top) (MASS True) of entries with x >= t. target = goal (counts) or goal * F(lo) (masses),
    F(lo) taken in the first pass."""
    target = goal
    ans = lo
    passes = tl.zeros([], tl.int32)
    searching = lo < hi
    while searching:
        piv = lo + (hi - lo) * ((tl.arange(0, K) + 1).to(tl.float32) / (K + 1))
        acc = tl.zeros([BLOCK, K], tl.float32)
        acc_lo = tl.zeros([BLOCK], tl.float32)
        vmin = tl.full([BLOCK], float("inf"), tl.float32)
        vmax = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = _scaled(row_ptr, cols, vocab, inv_t)
            if MASS:
                w = tl.exp(x - top)
            else:
                w = tl.where(x > float("-inf"), 1.0, 0.0)
            acc += tl.where(x[:, None] >= piv[None, :], w[:, None], 0.0)
            above = x >= lo
            acc_lo += tl.where(above, w, 0.0)
            inside = above & (x < hi)
            vmin = tl.minimum(vmin, tl.where(inside, x, float("inf")))
            vmax = tl.maximum(vmax, tl.where(inside, x, float("-inf")))
        f = tl.sum(acc, 0)
        if MASS:
            target = tl.where(passes == 0, goal * tl.sum(acc_lo, 0), target)
        vmin_all = tl.min(vmin, 0)
        vmax_all = tl.max(vmax, 0)
        feasible = f >= target
        new_lo = tl.maximum(tl.max(tl.where(feasible, piv, float("-inf")), 0), vmin_all)
        new_hi = tl.min(tl.where(feasible, float("inf"), piv), 0)
        # one distinct value left in [lo, hi): it is the answer (an empty interval, which the invariant rules out,
        # would keep lo)
        ans = tl.where(vmin_all == vmax_all, vmin_all, lo)
        passes += 1
        searching = (vmin_all < vmax_all) & (passes < MAX_PASSES)
        lo = tl.maximum(lo, new_lo)
        hi = tl.minimum(hi, new_hi)
    return ans


@triton.jit
def _threshold_kernel(logits_ptr, stride, inv_temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, vocab,
                      K: tl.constexpr, BLOCK: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Grid (rows,). out[r]: the cut-off of row r in x = logit * inv_temp units (-inf: keep every token)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    inv_t = tl.load(inv_temps_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    threshold = tl.full([], float("-inf"), tl.float32)
    if (k > 0.0) | (p < 1.0) | (min_p > 0.0):
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        low = tl.full([BLOCK], float("inf"), tl.float32)
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            x = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
            finite = x > float("-inf")
            top = tl.maximum(top, x)
            low = tl.minimum(low, tl.where(finite, x, float("inf")))
            count += finite.to(tl.int32)
        top_all = tl.max(top, 0)
        low_all = tl.min(low, 0)
        finite_all = tl.sum(count, 0)
        above_top = top_all + 1.0 + tl.abs(top_all) * 0.001  # any value past the row's max: F = 0 there
        if finite_all > 0:
            if (k > 0.0) & (k < finite_all.to(tl.float32)):
                threshold = _search(row_ptr, vocab, inv_t, top_all, low_all, above_top, k,
                                    False, K, BLOCK, MAX_PASSES)
            if p < 1.0:
                threshold = _search(row_ptr, vocab, inv_t, top_all, tl.maximum(threshold, low_all), above_top,
                                    p, True, K, BLOCK, MAX_PASSES)
            if min_p > 0.0:
                threshold = tl.maximum(threshold, top_all + tl.log(min_p))
    tl.store(out_ptr + row, threshold)


def filter_thresholds(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (float32/bf16; -inf = excluded), inv_temps / top_k / top_p / min_p [n] float32 (top_k: a whole
    number, 0 = off) -> [n] float32 thresholds on x = logit * inv_temp: a row keeps the tokens with x >= its
    threshold (-inf: all)."""
    n, vocab = logits.shape
    # The search reads float32: at batch 256 x 151,936 on an H200 the whole top-p call took 1.35 ms from float32
    # logits and 2.00 ms from bf16 ones (its passes over bf16 rows ran about twice as long), and a copy costs one
    # pass. The cast is exact, so the cut-off is the same value the draw compares with the bf16 logits.
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _threshold_kernel[(n,)](logits, logits.stride(0), inv_temps, top_k, top_p, min_p, out, vocab,
                                K=_PIVOTS, BLOCK=_BLOCK, MAX_PASSES=_MAX_PASSES, num_warps=8)
    return out


def filter_thresholds_ref(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: torch.Tensor) -> torch.Tensor:
    """The same thresholds with a sort (the reference the kernel is tested against)."""
    x = logits.float() * inv_temps.float().unsqueeze(1)
    n, vocab = x.shape
    sorted_x = torch.sort(x, dim=1, descending=True).values
    finite = (sorted_x > float("-inf")).sum(dim=1)
    out = torch.full((n,), float("-inf"), device=x.device)
    k = top_k.long()
    use_k = (k > 0) & (k < finite)
    kth = sorted_x.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1)).squeeze(1)
    out = torch.where(use_k, kth, out)
    # top-p over the tokens top-k keeps: the first sorted position whose inclusive cumulative mass reaches p
    kept = sorted_x.masked_fill(sorted_x < out.unsqueeze(1), float("-inf"))
    weights = torch.exp(kept - sorted_x[:, :1])
    mass = torch.cumsum(weights.double(), dim=1)
    reach = mass >= top_p.double().unsqueeze(1) * mass[:, -1:]
    first = reach.to(torch.int8).argmax(dim=1, keepdim=True)
    out = torch.where(top_p < 1.0, torch.maximum(out, sorted_x.gather(1, first).squeeze(1)), out)
    out = torch.where(min_p > 0.0, torch.maximum(out, sorted_x[:, 0] + torch.log(min_p.float())), out)
    return torch.where(finite > 0, out, torch.full_like(out, float("-inf")))
