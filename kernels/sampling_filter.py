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

The search. Each row is split into PARTS parts, one program each, in every launch (a fixed number, so the sums'
order depends on the row alone, never on the batch or on the TP rank). A search keeps lo (a value whose F(lo) =
count or mass of x >= lo reaches the target) and hi (one whose F does not); a pass evaluates F at K evenly spaced
pivots in (lo, hi) and the smallest and largest x in [lo, hi), per part, and the interval shrinks K + 1 times.
A search ends when [lo, hi) holds a single distinct value: that value is the threshold.
- Top-p starts at lo = max x + log((1 - p) / n) (n finite tokens), which is feasible: the tokens below it each
  weigh less than (1 - p) / n, so together less than (1 - p) <= (1 - p) * mass, the max weighing 1.
- Compaction: a part whose entries in [lo, hi) fit CAP slots (bounded from the last pass's per-part counts, or for
  masses by mass / smallest weight) copies them once into a buffer of its own; its later passes read only that
  buffer (F = the mass above the copied range + the buffer's). A part that does not fit keeps scanning its chunk.
- One launch per pass and no host sync: the last program of a row to finish (an atomic ticket per row) folds the
  parts' results in a fixed order into the row's next state, so the next launch's programs read 16 numbers; rows
  that finished skip the launch. The ticket decides only who folds, never an order of sums.
The host launches PASSES passes per search; a search still open after them keeps lo, a superset of at most the
values within (range of x) / (K + 1)^PASSES of the exact cut-off. Every fold writes the row's current cut-off
(min-p applied).

`filter_thresholds_ref` computes the same thresholds in torch with a sort: the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.sampling_fold import (_COUNT, _DONE, _MASS, _PSTATE, _SLOTS, _STATE, fold_init,
                                              fold_pass, scaled, weight)

# Launch settings: the passes are bound by latency, so small programs that fit many to an SM are faster (larger
# steps or more warps took more registers a program and made a search slower; docs/performance-history.md).
_BLOCK = 128  # entries per step of a pass's pivot loops
_COPY_BLOCK = 512  # entries per step of the compaction loop
_PARTS = 32  # programs per row in every launch, at most (one per 8 * _BLOCK entries, a power of two)
_PIVOTS = 16  # pivots per pass: the interval shrinks 17 times a pass
_PASSES = 6  # pass launches per search: 17^6 = 2.4e7 intervals (a finished row skips a launch's work)
_CAP = 512  # compacted entries per (row, part)
_FIT = None  # a part copies when its bound on [lo, hi)'s entries is at most this (None: _CAP; tests set more, so
# that copies overflow and the part scans its chunk in the same pass)
_STATS_BLOCK = 2048  # entries per step of the stats launch
_STATS_WARPS = 4
_PASS_WARPS = 4  # warps per program of a pass launch
_PASS_STAGES = None  # software-pipelining stages of a pass launch (None: Triton's default)

__all__ = ["filter_thresholds", "filter_thresholds_ref", "_COUNT", "_MASS", "_DONE"]


@triton.jit
def _stats_kernel(logits_ptr, stride, inv_temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr, pstate_ptr,
                  state_ptr, ticket_ptr, out_ptr, vocab, chunk, PARTS: tl.constexpr, SLOTS: tl.constexpr,
                  FIT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, PARTS): each part's max, min finite and finite count; the last part of a row folds them into the
    row's first search (fold_init)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = logits_ptr + row * stride
    inv_t = tl.load(inv_temps_ptr + row)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    end = tl.minimum(part * chunk + chunk, vocab)
    for start in range(part * chunk, end, BLOCK):
        x = scaled(row_ptr, start + tl.arange(0, BLOCK), end, inv_t)
        finite = x > float("-inf")
        top = tl.maximum(top, x)
        low = tl.minimum(low, tl.where(finite, x, float("inf")))
        count += finite.to(tl.float32)
    out = part_ptr + (row * PARTS + part) * SLOTS
    tl.store(out, tl.max(top, 0))
    tl.store(out + 1, tl.min(low, 0))
    tl.store(out + 2, tl.sum(count, 0))
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + row, 1)
    if ticket == PARTS - 1:
        fold_init(part_ptr, pstate_ptr, state_ptr, out_ptr, row, tl.load(top_k_ptr + row), tl.load(top_p_ptr + row),
                  tl.load(min_p_ptr + row), PARTS, SLOTS, FIT)
        tl.store(ticket_ptr + row, 0)


@triton.jit
def _pivot_tile(x, w, lo, hi, piv, acc, acc_lo, acc_hi, vmin, vmax):
    """One tile's contribution to F at the pivots, at lo and at hi, and to the extremes of x in [lo, hi)."""
    acc += tl.where(x[:, None] >= piv[None, :], w[:, None], 0.0)
    acc_lo += tl.where(x >= lo, w, 0.0)
    acc_hi += tl.where(x >= hi, w, 0.0)
    inside = (x >= lo) & (x < hi)
    vmin = tl.minimum(vmin, tl.where(inside, x, float("inf")))
    vmax = tl.maximum(vmax, tl.where(inside, x, float("-inf")))
    return acc, acc_lo, acc_hi, vmin, vmax


@triton.jit
def _pass_kernel(logits_ptr, stride, inv_temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr, pstate_ptr,
                 state_ptr, ticket_ptr, out_ptr, cand_ptr, vocab, chunk, PARTS: tl.constexpr, K: tl.constexpr,
                 SLOTS: tl.constexpr, PASSES: tl.constexpr, CAP: tl.constexpr, FIT: tl.constexpr,
                 BLOCK: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """Grid (rows, PARTS): one pass of the row's search over this part (its chunk, or its compacted entries), then
    the last part of the row folds the pass (fold_pass). A finished row does nothing."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    st = state_ptr + row * 16
    phase = tl.load(st + 3)
    if phase < 2.0:
        lo = tl.load(st)
        hi = tl.load(st + 1)
        top = tl.load(st + 5)
        base = tl.load(st + 8)
        mass = phase == 1.0
        ps = pstate_ptr + (row * PARTS + part) * 4
        n_cand = tl.load(ps)
        compact = n_cand >= 0.0
        do_compact = (~compact) & (tl.load(ps + 2) > 0.0)
        row_ptr = logits_ptr + row * stride
        inv_t = tl.load(inv_temps_ptr + row)
        cand = cand_ptr + (row * PARTS + part) * CAP
        start_col = part * chunk
        end_col = tl.minimum(start_col + chunk, vocab)
        acc_all = tl.zeros([COPY_BLOCK], tl.float32)
        # (a) compaction: copy the part's x in [lo, hi) into its buffer, in chunk order (so the buffer does not
        # depend on COPY_BLOCK); the mass above hi and above base
        acc_above = tl.zeros([COPY_BLOCK], tl.float32)
        n = tl.zeros([], tl.int32)
        for start in range(start_col, tl.where(do_compact, end_col, start_col), COPY_BLOCK):
            x = scaled(row_ptr, start + tl.arange(0, COPY_BLOCK), end_col, inv_t)
            w = weight(x, top, mass)
            acc_above += tl.where(x >= hi, w, 0.0)
            acc_all += tl.where(x >= base, w, 0.0)
            inside = (x >= lo) & (x < hi)
            pos = n + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(cand + pos, x, mask=inside & (pos < CAP))
            n += tl.sum(inside.to(tl.int32), 0)
        fits = n <= CAP
        if do_compact:
            tl.store(ps, tl.where(fits, n.to(tl.float32), -1.0))
            tl.store(ps + 1, tl.sum(acc_above, 0))
        tl.debug_barrier()  # the copied entries, read back below
        # (b) the chunk with the pivots: not compact, or the copy overflowed
        piv = lo + (hi - lo) * ((tl.arange(0, K) + 1).to(tl.float32) / (K + 1))
        acc = tl.zeros([BLOCK, K], tl.float32)
        acc_lo = tl.zeros([BLOCK], tl.float32)
        acc_hi = tl.zeros([BLOCK], tl.float32)
        vmin = tl.full([BLOCK], float("inf"), tl.float32)
        vmax = tl.full([BLOCK], float("-inf"), tl.float32)
        scan = (~compact) & ((~do_compact) | (~fits))
        acc_all_scan = tl.zeros([BLOCK], tl.float32)
        for start in range(start_col, tl.where(scan, end_col, start_col), BLOCK):
            x = scaled(row_ptr, start + tl.arange(0, BLOCK), end_col, inv_t)
            w = weight(x, top, mass)
            acc_all_scan += tl.where(x >= base, w, 0.0)
            acc, acc_lo, acc_hi, vmin, vmax = _pivot_tile(x, w, lo, hi, piv, acc, acc_lo, acc_hi, vmin, vmax)
        # (c) the compacted entries with the pivots, on top of the mass above the copied range
        n_read = tl.where(compact, n_cand.to(tl.int32), tl.where(do_compact & fits, n, 0))
        for start in range(0, n_read, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(cand + idx, mask=idx < n_read, other=float("-inf"), cache_modifier=".cg")
            w = weight(x, top, mass)
            acc, acc_lo, acc_hi, vmin, vmax = _pivot_tile(x, w, lo, hi, piv, acc, acc_lo, acc_hi, vmin, vmax)
        offset = tl.where(compact, tl.load(ps + 1), tl.where(do_compact & fits, tl.sum(acc_above, 0), 0.0))
        out = part_ptr + (row * PARTS + part) * SLOTS
        tl.store(out + tl.arange(0, K), offset + tl.sum(acc, 0))
        tl.store(out + K, offset + tl.sum(acc_lo, 0))
        tl.store(out + K + 1, offset + tl.sum(acc_hi, 0))
        tl.store(out + K + 2, tl.min(vmin, 0))
        tl.store(out + K + 3, tl.max(vmax, 0))
        tl.store(out + K + 4, tl.where(do_compact, tl.sum(acc_all, 0), tl.sum(acc_all_scan, 0)))
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + row, 1)
        if ticket == PARTS - 1:
            fold_pass(part_ptr, pstate_ptr, state_ptr, out_ptr, row, tl.load(top_p_ptr + row),
                      tl.load(min_p_ptr + row), PARTS, K, SLOTS, PASSES, FIT)
            tl.store(ticket_ptr + row, 0)


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
    chunk = triton.cdiv(triton.cdiv(vocab, num_parts), _BLOCK) * _BLOCK
    states = torch.empty(n, _STATE, dtype=torch.float32, device=logits.device)
    parts = torch.empty(n, num_parts, _SLOTS, dtype=torch.float32, device=logits.device)
    pstate = torch.empty(n, num_parts, _PSTATE, dtype=torch.float32, device=logits.device)
    cand = torch.empty(n, num_parts, _CAP, dtype=torch.float32, device=logits.device)
    tickets = torch.zeros(n, dtype=torch.int32, device=logits.device)
    args = (logits, logits.stride(0), inv_temps, top_k, top_p, min_p, parts, pstate, states, tickets, out)
    fit = _CAP if _FIT is None else _FIT
    _stats_kernel[(n, num_parts)](*args, vocab, chunk, PARTS=num_parts, SLOTS=_SLOTS, FIT=fit, BLOCK=_STATS_BLOCK,
                                  num_warps=_STATS_WARPS)
    stages = {} if _PASS_STAGES is None else {"num_stages": _PASS_STAGES}
    for _ in range(_PASSES * (2 if count_search else 1)):
        _pass_kernel[(n, num_parts)](*args, cand, vocab, chunk, PARTS=num_parts, K=_PIVOTS, SLOTS=_SLOTS,
                                     PASSES=_PASSES, CAP=_CAP, FIT=fit, BLOCK=_BLOCK, COPY_BLOCK=_COPY_BLOCK,
                                     num_warps=_PASS_WARPS, **stages)
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
