"""Top-k, top-p and min-p as masks on temperature-scaled logits (-inf where a token is excluded), without a sort
of the vocabulary; and the clamped exp that the filter and the CPU draw share."""

from __future__ import annotations

import math

import torch

from shardserve.worker.device_copy import device_tensor
from shardserve.worker.sampling_row import SamplingRow

TOP_P_CANDIDATES = 256  # a row's top-p cut-off is looked for among its largest logits first (then 8x as many)

# Weights at most this are set to 0: e^-87 (the clamp's value, float32's smallest normal range) with a margin over
# its rounding
_UNDERFLOW = math.exp(-87.0) * 1.001


def uses_filters(rows: list[SamplingRow]) -> bool:
    return any(r.spec.top_k > 0 or r.spec.top_p < 1.0 or r.spec.min_p > 0.0 for r in rows)


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature-scaled logits -> the same with -inf where top-k, top-p or min-p exclude a token."""
    top_k = [r.spec.top_k for r in rows]
    top_p = [r.spec.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = filter_top_k_top_p(logits, top_k, top_p)
    min_p = [r.spec.min_p for r in rows]
    if any(m > 0.0 for m in min_p):
        # probs >= m * max(probs)  <=>  logit >= max(logit) + log(m)  (m = 0: log 0 = -inf, nothing dropped)
        log_m = torch.log(device_tensor(min_p, torch.float32, logits.device)).unsqueeze(1)
        logits = logits.masked_fill(logits < logits.max(dim=1, keepdim=True).values + log_m, float("-inf"))
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) what top-k and top-p exclude: each row keeps its logits >= a threshold (the smallest kept
    value; tokens tied with it are kept too, as the GPU's search keeps them). top_k 0 and top_p 1 leave a row
    untouched. No sort of the vocabulary: top-p's cut-off is found among each row's largest TOP_P_CANDIDATES
    logits (torch.topk, sorted), over probabilities normalised by the whole row's (or its top-k's) log-sum-exp,
    and looked for among 8x as many where some row's kept mass reaches past them (flat distributions): on the CPU
    torch.topk of 256 takes a small fraction of a full sort's time."""
    n, vocab = logits.shape
    device = logits.device
    k = device_tensor([kk if 0 < kk < vocab else vocab for kk in top_k], torch.int64, device).unsqueeze(1)
    if all(pp >= 1.0 for pp in top_p):
        # top-k only: the k-th largest value is the threshold (ties with it are kept).
        active = [kk for kk in top_k if 0 < kk < vocab]
        if not active:
            return logits
        kmax = max(active)
        top_vals = torch.topk(logits, kmax, dim=1).values
        threshold = top_vals.gather(1, (k.clamp(max=kmax) - 1))
        threshold = torch.where(k >= vocab, torch.full_like(threshold, float("-inf")), threshold)
        return logits.masked_fill(logits < threshold, float("-inf"))
    p = device_tensor(top_p, torch.float32, device).unsqueeze(1)
    untouched = (k >= vocab) & (p >= 1.0)
    # the normaliser where no top-k applies (a pass over the whole rows: only where some row has none)
    whole_row = logsumexp_rows(logits) if any(not 0 < kk < vocab for kk in top_k) else None
    width = min(vocab, max([TOP_P_CANDIDATES] + [kk for kk in top_k if 0 < kk < vocab]))
    while True:
        values = torch.topk(logits, width, dim=1).values.float()  # [n, width], largest first
        in_top_k = torch.arange(width, device=device).unsqueeze(0) < k
        candidates = values.masked_fill(~in_top_k, float("-inf"))
        normaliser = logsumexp_rows(candidates)
        if whole_row is not None:
            normaliser = torch.where(k < vocab, normaliser, whole_row)
        probs = torch.exp(candidates - normaliser)
        mass_before = torch.cumsum(probs, dim=1) - probs
        # keep the smallest prefix whose mass reaches top_p: drop a token once the tokens before it already do
        kept = (in_top_k & ((mass_before < p) | (p >= 1.0))).sum(1, keepdim=True)  # (a prefix: its length)
        if width == vocab or bool(((kept < width) | (k <= width) | untouched).all()):
            break
        width = min(vocab, width * 8)
    threshold = values.gather(1, (kept - 1).clamp(min=0)).to(logits.dtype)
    threshold = torch.where(untouched, torch.full_like(threshold, float("-inf")), threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, V] -> [n, 1] float32 log-sum-exp of each row, through clamped_exp_ (torch.logsumexp's exp takes the
    slow path where the result underflows)."""
    top = x.max(dim=1, keepdim=True).values.float()
    return top + clamped_exp_(x.float() - top).sum(dim=1, keepdim=True).log_()


def clamped_exp_(shifted: torch.Tensor) -> torch.Tensor:
    """In place: exp of values <= 0 (logits less their row's max), exactly 0 below -87 (e^-87 ~ 1.6e-38: weight
    nothing beside the row's largest, 1). torch's CPU exp takes a slow path for arguments whose result underflows:
    16-38x the time for those below -87 and 4x for -inf (the masked tokens), at 32 x 49,152 up to ~25 ms against
    0.7 (docs/performance-history.md); temperature-scaled logits of a confident model reach there. In place (and
    the zeros by a threshold rather than a mask): each new 6 MB tensor of that size is paid in page faults."""
    return torch.nn.functional.threshold_(shifted.clamp_(min=-87.0).exp_(), _UNDERFLOW, 0.0)
