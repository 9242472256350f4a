"""The row state of the sort-free cut-off search (kernels/sampling_filter.py) and the folds that move it on.

A fold runs in the last program of a row to finish a launch (the one that took the last ticket): it reduces the
parts' results in a fixed order (so every TP rank, and every batch the row is in, reaches the same state) and
writes the row's next state, each part's compaction advice, and the row's cut-off so far.

Row state (float32 x _STATE): lo, hi, target (k, or p * mass once known), phase (_COUNT, _MASS, _DONE), passes done
in the search, top (max x), threshold (the last finished search's), finite (tokens with x > -inf), base (top-p's
mass counts x >= base: the top-k cut-off, or -inf).
Per (row, part) (_PSTATE): compacted entries (-1: none), the part's F above the copied range, fit (1: the next
pass's [lo, hi) holds at most FIT entries, the buffer's capacity unless a test asks for more). Per (row, part) results (_SLOTS): the stats launch's max, min, count;
a pass's F at the K pivots, F(lo), F(hi), min and max of x in [lo, hi), mass of x >= base.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SLOTS = 32
_STATE = 16
_PSTATE = 4
_COUNT, _MASS, _DONE = 0.0, 1.0, 2.0  # phases


@triton.jit
def scaled(row_ptr, cols, end, inv_t):
    """x = logit * (1 / T) as float32; -inf from `end` on (the part's end: the same product the Gumbel kernel
    compares)."""
    logit = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
    return logit * inv_t


@triton.jit
def weight(x, top, mass):
    """What F sums per token: exp(x - top) in the mass search, 1 per finite token in the count search."""
    return tl.where(mass, tl.exp(x - top), tl.where(x > float("-inf"), 1.0, 0.0))


@triton.jit
def _p_start(top, p, finite):
    """A feasible first lo for top-p: below it the tokens weigh < (1 - p) / finite each (0.01 of slack for the
    float32 rounding of the log)."""
    return top + tl.log((1.0 - p) / finite) - 0.01


@triton.jit
def _with_min_p(threshold, top, min_p, finite):
    return tl.where((min_p > 0.0) & (finite > 0.0), tl.maximum(threshold, top + tl.log(min_p)), threshold)


@triton.jit
def fold_init(part_ptr, pstate_ptr, state_ptr, out_ptr, row, k, p, min_p, PARTS: tl.constexpr, SLOTS: tl.constexpr,
              FIT: tl.constexpr):
    """The stats launch's parts (max, min, count) -> the row's first search: top-k's count search over [min, max]
    where top-k cuts, else top-p's mass search from _p_start, else done."""
    parts = tl.arange(0, PARTS)
    base = part_ptr + (row * PARTS + parts) * SLOTS
    top = tl.max(tl.load(base, cache_modifier=".cg"), 0)
    low = tl.min(tl.load(base + 1, cache_modifier=".cg"), 0)
    counts = tl.load(base + 2, cache_modifier=".cg")
    finite = tl.sum(counts, 0)
    use_k = (finite > 0.0) & (k > 0.0) & (k < finite)
    use_p = (finite > 0.0) & (p < 1.0)
    phase = tl.where(use_k, 0.0, tl.where(use_p, 1.0, 2.0))
    lo = tl.where(use_k, low, tl.maximum(low, _p_start(top, p, finite)))
    st = state_ptr + row * 16
    tl.store(st, lo)
    tl.store(st + 1, top + 1.0 + tl.abs(top) * 0.001)  # past the row's max: F = 0 there
    tl.store(st + 2, tl.where(use_k, k, 0.0))
    tl.store(st + 3, phase)
    tl.store(st + 4, 0.0)
    tl.store(st + 5, top)
    tl.store(st + 6, float("-inf"))
    tl.store(st + 7, finite)
    tl.store(st + 8, float("-inf"))
    ps = pstate_ptr + (row * PARTS + parts) * 4
    tl.store(ps, tl.full([PARTS], -1.0, tl.float32))
    tl.store(ps + 2, tl.where(counts <= FIT, 1.0, 0.0))  # a part's finite count bounds what [lo, hi) holds
    tl.store(out_ptr + row, _with_min_p(tl.where(phase == 2.0, float("-inf"), lo), top, min_p, finite))


@triton.jit
def fold_pass(part_ptr, pstate_ptr, state_ptr, out_ptr, row, p, min_p, PARTS: tl.constexpr, K: tl.constexpr,
              SLOTS: tl.constexpr, PASSES: tl.constexpr, FIT: tl.constexpr):
    """A pass's parts -> the search's next interval, or its end (one value left in [lo, hi), or PASSES passes: a
    search cut short keeps lo) and the next search (top-p after top-k) or done."""
    st = state_ptr + row * 16
    lo = tl.load(st, cache_modifier=".cg")
    hi = tl.load(st + 1, cache_modifier=".cg")
    target = tl.load(st + 2, cache_modifier=".cg")
    phase = tl.load(st + 3, cache_modifier=".cg")
    passes = tl.load(st + 4, cache_modifier=".cg")
    top = tl.load(st + 5, cache_modifier=".cg")
    threshold = tl.load(st + 6, cache_modifier=".cg")
    finite = tl.load(st + 7, cache_modifier=".cg")
    base = tl.load(st + 8, cache_modifier=".cg")
    parts = tl.arange(0, PARTS)
    kk = tl.arange(0, K)
    prow = part_ptr + (row * PARTS + parts) * SLOTS
    f2 = tl.load(prow[:, None] + kk[None, :], cache_modifier=".cg")  # [PARTS, K]
    f_lo_p = tl.load(prow + K, cache_modifier=".cg")
    f_hi_p = tl.load(prow + K + 1, cache_modifier=".cg")
    vmin = tl.min(tl.load(prow + K + 2, cache_modifier=".cg"), 0)
    vmax = tl.max(tl.load(prow + K + 3, cache_modifier=".cg"), 0)
    f_all = tl.sum(tl.load(prow + K + 4, cache_modifier=".cg"), 0)
    f = tl.sum(f2, 0)
    mass = phase == 1.0
    target = tl.where(mass & (passes == 0.0), p * f_all, target)
    piv = lo + (hi - lo) * ((kk + 1).to(tl.float32) / (K + 1))
    feasible = f >= target  # a prefix of the pivots: F never grows with the pivot
    n_feasible = tl.sum(feasible.to(tl.int32), 0)
    new_lo = tl.maximum(tl.max(tl.where(feasible, piv, float("-inf")), 0), vmin)
    new_hi = tl.min(tl.where(feasible, float("inf"), piv), 0)
    single = vmin == vmax
    result = tl.where(single, vmin, lo)
    ends = (vmin >= vmax) | (passes + 1.0 >= PASSES)
    # each part's F at the next interval's ends (no entry lies between the last feasible pivot and vmin)
    f_at_lo = tl.where(n_feasible > 0, tl.sum(tl.where(kk[None, :] == n_feasible - 1, f2, 0.0), 1), f_lo_p)
    f_at_hi = tl.where(n_feasible < K, tl.sum(tl.where(kk[None, :] == n_feasible, f2, 0.0), 1), f_hi_p)
    lo_go = tl.maximum(lo, new_lo)
    hi_go = tl.minimum(hi, new_hi)
    # entries per part in the next interval: counts, or (masses) at most mass / the lightest entry's weight
    span = f_at_lo - f_at_hi
    entries = tl.where(mass, span * tl.exp(top - lo_go) * 1.01 + 1.0, span)
    entries = tl.where(ends, tl.where(single, f_at_lo, f_lo_p), entries)  # after top-k: its kept count per part
    next_phase = tl.where((phase == 0.0) & (p < 1.0), 1.0, 2.0)
    to_mass = ends & (next_phase == 1.0)
    threshold = tl.where(ends, result, threshold)
    lo = tl.where(ends, tl.where(to_mass, tl.maximum(result, _p_start(top, p, finite)), result), lo_go)
    phase = tl.where(ends, next_phase, phase)
    tl.store(st, lo)
    tl.store(st + 1, tl.where(ends, top + 1.0 + tl.abs(top) * 0.001, hi_go))
    tl.store(st + 2, tl.where(ends, 0.0, target))
    tl.store(st + 3, phase)
    tl.store(st + 4, tl.where(ends, 0.0, passes + 1.0))
    tl.store(st + 6, threshold)
    tl.store(st + 8, tl.where(to_mass, result, base))
    ps = pstate_ptr + (row * PARTS + parts) * 4
    tl.store(ps, tl.full([PARTS], -1.0, tl.float32), mask=parts < tl.where(ends, PARTS, 0))  # a new search copies anew
    tl.store(ps + 2, tl.where(entries <= FIT, 1.0, 0.0))
    tl.store(out_ptr + row, _with_min_p(tl.where(phase == 2.0, threshold, lo), top, min_p, finite))
