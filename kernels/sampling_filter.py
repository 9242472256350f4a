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

The search: each row is split into PARTS parts, one program each, in every launch (a fixed number, so the sums'
order depends on the row alone, never on the batch or on the TP rank). The first launch takes each part's max, min
and number of finite entries. Each search keeps lo (a value whose F(lo) = count or mass of x >= lo reaches the
target) and hi (one whose F does not); a pass launch evaluates F at K evenly spaced pivots in (lo, hi), and the
smallest and largest x in [lo, hi), per part. The next launch's programs each reduce the previous launch's per-part
results in the same fixed order and move the row's state on (the interval shrinks K + 1 times a pass), so a pass
costs one launch and no host sync; a search ends when [lo, hi) holds a single distinct value: that value is the
threshold. The host launches PASSES passes per search (a row that has finished skips its parts' work); a search
still open after them keeps lo, a superset of at most the values within (range of x) / (K + 1)^PASSES of the
exact cut-off. The last launch (one program per row) applies the final reduction and min-p.

`filter_thresholds_ref` computes the same thresholds in torch with a sort: the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 512
_PARTS = 32  # programs per row in every launch, at most (one per 4,096 entries, a power of two: 32 at 151,936)
_PIVOTS = 16  # pivots per pass: the interval shrinks 17 times a pass
_PASSES = 7  # pass launches per search: 17^7 = 4.1e8 intervals
_SLOTS = 32  # per (row, part) results: F at the K pivots, F(lo), min and max of x in [lo, hi) (stats: max, min, count)
_STATE = 8  # per row: lo, hi, target, phase, passes, top, threshold, finite count
_INIT, _COUNT, _MASS, _DONE = -1.0, 0.0, 1.0, 2.0  # phases


@triton.jit
def _scaled(row_ptr, cols, vocab, inv_t):
    """x = logit * (1 / T) as float32; -inf past the row's end (the same product the Gumbel kernel compares)."""
    logit = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    return logit * inv_t


@triton.jit
def _stats_kernel(logits_ptr, stride, inv_temps_ptr, part_ptr, state_ptr, vocab, chunk,
                  PARTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, PARTS): each part's max, min finite and finite count; part 0 marks the row's state INIT."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = logits_ptr + row * stride
    inv_t = tl.load(inv_temps_ptr + row)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    for start in range(part * chunk, tl.minimum(part * chunk + chunk, vocab), BLOCK):
        x = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
        finite = x > float("-inf")
        top = tl.maximum(top, x)
        low = tl.minimum(low, tl.where(finite, x, float("inf")))
        count += finite.to(tl.float32)
    out = part_ptr + (row * PARTS + part) * SLOTS
    tl.store(out, tl.max(top, 0))
    tl.store(out + 1, tl.min(low, 0))
    tl.store(out + 2, tl.sum(count, 0))
    if part == 0:
        s = tl.arange(0, 8)
        tl.store(state_ptr + row * 8 + s, tl.where(s == 3, -1.0, 0.0))


@triton.jit
def _advance(state_ptr, part_ptr, row, k, p, FORCE: tl.constexpr, PARTS: tl.constexpr, K: tl.constexpr,
             SLOTS: tl.constexpr, PASSES: tl.constexpr):
    """A row's state after the launch that wrote part_ptr: INIT -> the first search (from the stats), a search ->
    its next interval, or its end (one value left, PASSES passes done, or FORCE) -> the next search or DONE.
    Every program of a row runs this on the same inputs in the same order, so all agree on the new state."""
    st = state_ptr + row * 8
    lo = tl.load(st)
    hi = tl.load(st + 1)
    target = tl.load(st + 2)
    phase = tl.load(st + 3)
    passes = tl.load(st + 4)
    top = tl.load(st + 5)
    threshold = tl.load(st + 6)
    finite = tl.load(st + 7)
    base = part_ptr + (row * PARTS + tl.arange(0, PARTS)) * SLOTS
    init = phase == -1.0
    search = (phase == 0.0) | (phase == 1.0)
    # INIT: the stats launch's results (slots 0-2: max, min, finite count)
    top = tl.where(init, tl.max(tl.load(base), 0), top)
    finite = tl.where(init, tl.sum(tl.load(base + 2), 0), finite)
    above_top = top + 1.0 + tl.abs(top) * 0.001  # past the row's max: F = 0 there
    use_k = (finite > 0.0) & (k > 0.0) & (k < finite)
    use_p = (finite > 0.0) & (p < 1.0)
    # a search: fold in the pass at pivots of (lo, hi)
    f = tl.sum(tl.load(base[:, None] + tl.arange(0, K)[None, :]), 0)
    f_lo = tl.sum(tl.load(base + K), 0)
    vmin = tl.min(tl.load(base + K + 1), 0)
    vmax = tl.max(tl.load(base + K + 2), 0)
    target = tl.where(search & (phase == 1.0) & (passes == 0.0), p * f_lo, target)
    piv = lo + (hi - lo) * ((tl.arange(0, K) + 1).to(tl.float32) / (K + 1))
    feasible = f >= target
    new_lo = tl.maximum(tl.max(tl.where(feasible, piv, float("-inf")), 0), vmin)
    new_hi = tl.min(tl.where(feasible, float("inf"), piv), 0)
    # one distinct value left in [lo, hi): it is the answer (an empty interval, which the invariant rules out, or a
    # search cut short keeps lo)
    result = tl.where(vmin == vmax, vmin, lo)
    ends = (vmin >= vmax) | (passes + 1.0 >= PASSES)
    if FORCE:
        ends = vmin == vmin
    ends = search & ends
    next_phase = tl.where((phase == 0.0) & (p < 1.0), 1.0, 2.0)  # after top-k, top-p searches the tokens it keeps
    go = search & ~ends
    threshold = tl.where(init, float("-inf"), tl.where(ends, result, threshold))
    lo_next = tl.where(init, tl.min(tl.load(base + 1), 0), tl.where(ends, result, tl.maximum(lo, new_lo)))
    hi = tl.where(init | ends, above_top, tl.where(go, tl.minimum(hi, new_hi), hi))
    lo = tl.where(init | search, lo_next, lo)
    target = tl.where(init, tl.where(use_k, k, 0.0), tl.where(ends, 0.0, target))
    passes = tl.where(init | ends, 0.0, tl.where(go, passes + 1.0, passes))
    phase = tl.where(init, tl.where(use_k, 0.0, tl.where(use_p, 1.0, 2.0)), tl.where(ends, next_phase, phase))
    return lo, hi, target, phase, passes, top, threshold, finite


@triton.jit
def _pass_kernel(logits_ptr, stride, inv_temps_ptr, top_k_ptr, top_p_ptr, state_in, part_in, state_out, part_out,
                 vocab, chunk, PARTS: tl.constexpr, K: tl.constexpr, SLOTS: tl.constexpr, PASSES: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Grid (rows, PARTS): advance the row's state (part 0 stores it), then this part's F at the new pivots."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    lo, hi, target, phase, passes, top, threshold, finite = _advance(state_in, part_in, row, k, p, False, PARTS, K,
                                                                     SLOTS, PASSES)
    if part == 0:
        st = state_out + row * 8
        tl.store(st, lo)
        tl.store(st + 1, hi)
        tl.store(st + 2, target)
        tl.store(st + 3, phase)
        tl.store(st + 4, passes)
        tl.store(st + 5, top)
        tl.store(st + 6, threshold)
        tl.store(st + 7, finite)
    if phase < 2.0:
        row_ptr = logits_ptr + row * stride
        inv_t = tl.load(inv_temps_ptr + row)
        mass = phase == 1.0
        piv = lo + (hi - lo) * ((tl.arange(0, K) + 1).to(tl.float32) / (K + 1))
        acc = tl.zeros([BLOCK, K], tl.float32)
        acc_lo = tl.zeros([BLOCK], tl.float32)
        vmin = tl.full([BLOCK], float("inf"), tl.float32)
        vmax = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(part * chunk, tl.minimum(part * chunk + chunk, vocab), BLOCK):
            x = _scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
            w = tl.where(mass, tl.exp(x - top), tl.where(x > float("-inf"), 1.0, 0.0))
            acc += tl.where(x[:, None] >= piv[None, :], w[:, None], 0.0)
            above = x >= lo
            acc_lo += tl.where(above, w, 0.0)
            inside = above & (x < hi)
            vmin = tl.minimum(vmin, tl.where(inside, x, float("inf")))
            vmax = tl.maximum(vmax, tl.where(inside, x, float("-inf")))
        out = part_out + (row * PARTS + part) * SLOTS
        tl.store(out + tl.arange(0, K), tl.sum(acc, 0))
        tl.store(out + K, tl.sum(acc_lo, 0))
        tl.store(out + K + 1, tl.min(vmin, 0))
        tl.store(out + K + 2, tl.max(vmax, 0))


@triton.jit
def _finish_kernel(top_k_ptr, top_p_ptr, min_p_ptr, state_in, part_in, out_ptr, PARTS: tl.constexpr,
                   K: tl.constexpr, SLOTS: tl.constexpr, PASSES: tl.constexpr):
    """Grid (rows,): the last pass folded in (a search still open ends at lo), then min-p. out[r]: the cut-off."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    lo, hi, target, phase, passes, top, threshold, finite = _advance(state_in, part_in, row, k, p, True, PARTS, K,
                                                                     SLOTS, PASSES)
    threshold = tl.where((min_p > 0.0) & (finite > 0.0), tl.maximum(threshold, top + tl.log(min_p)), threshold)
    tl.store(out_ptr + row, threshold)


def filter_thresholds(logits: torch.Tensor, inv_temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, count_search: bool = True) -> torch.Tensor:
    """logits [n, V] (float32/bf16/fp16; -inf = excluded), inv_temps / top_k / top_p / min_p [n] float32 (top_k: a
    whole number, 0 = off) -> [n] float32 thresholds on x = logit * inv_temp: a row keeps the tokens with x >= its
    threshold (-inf: all). count_search=False: the caller knows no row has a top-k below its vocabulary (the
    launches of the count search are left out)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if not n:
        return out
    # parts per row: a function of the vocabulary only, so a row's sums never depend on its batch
    num_parts = max(2, min(_PARTS, triton.next_power_of_2(triton.cdiv(vocab, 8 * _BLOCK))))
    states = torch.empty(2, n, _STATE, dtype=torch.float32, device=logits.device)
    parts = torch.empty(2, n, num_parts, _SLOTS, dtype=torch.float32, device=logits.device)
    chunk = triton.cdiv(triton.cdiv(vocab, num_parts), _BLOCK) * _BLOCK
    _stats_kernel[(n, num_parts)](logits, logits.stride(0), inv_temps, parts[0], states[0], vocab, chunk,
                                  PARTS=num_parts, SLOTS=_SLOTS, BLOCK=_BLOCK, num_warps=4)
    launches = _PASSES * (2 if count_search else 1)
    for i in range(launches):
        src, dst = i % 2, (i + 1) % 2
        _pass_kernel[(n, num_parts)](logits, logits.stride(0), inv_temps, top_k, top_p, states[src], parts[src],
                                     states[dst], parts[dst], vocab, chunk, PARTS=num_parts, K=_PIVOTS,
                                     SLOTS=_SLOTS, PASSES=_PASSES, BLOCK=_BLOCK, num_warps=8)
    last = launches % 2
    _finish_kernel[(n,)](top_k, top_p, min_p, states[last], parts[last], out, PARTS=num_parts, K=_PIVOTS,
                         SLOTS=_SLOTS, PASSES=_PASSES, num_warps=1)
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
