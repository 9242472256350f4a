"""Picks each request's next token from the model's logits: penalties, min_tokens, greedy or seeded sampling, logprobs.

Design decision: randomness is a pure function of (seed, index of the token being generated).
Each sampled row hashes its (seed, index) with splitmix64 into a 64-bit key. On CPU the key gives one uniform u in
(0, 1) and the row takes the first token whose cumulative probability reaches u (inverse-CDF sampling: token i
comes out with probability probs[i], and a token with probability 0 never does); one draw per row, because a draw
per vocabulary entry cost ~40 ms a step on CPU at batch 32. On CUDA a Triton kernel hashes the key with each token
index into Gumbel noise and takes the argmax (kernels/sampling.py): one pass over the logits instead of softmax,
a float64 cumulative sum and a search (that torch path took 1.36 ms a step at batch 256 x 152k vocabulary on an
H200). Both draw exactly from the filtered softmax; they are different draws, so the same seed gives
different (equally distributed) tokens on CPU and on GPU. No generator state, so:
- a request's tokens do not depend on what else is in the batch or on its row order;
- after a preemption the request resumes with the same draws (the index is the number of tokens it generated
  before, which the resumed request carries);
- every tensor-parallel rank holds the full logits and computes the same draws, so all ranks sample the same token
  with no broadcast of sampled tokens. (This relies on the all-reduce and all-gather leaving bitwise-identical
  tensors on every rank, which ring/tree collectives in gloo and NCCL do: each rank ends with the same copies.)

Order of transforms (vLLM/HF semantics): logit_bias (added), repetition penalty (prompt + generated tokens),
presence/frequency penalties (generated tokens), min_tokens (stop ids masked), then greedy rows take the argmax;
sampled rows apply temperature, top-k, top-p, min-p and the draw. Logprobs come from the raw logits, before any of
this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from shardserve.proto.plan import SamplingSpec, TokenLogprobs
from shardserve.worker.device_copy import device_tensor
from shardserve.worker.sampling_keys import row_key, row_keys_split, uniform_draw


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: the request's settings and its tokens so far."""

    spec: SamplingSpec
    token_ids: Sequence[int]  # prompt + generated (the sampled token is not in it yet)
    num_prompt_tokens: int

    @property
    def output_index(self) -> int:
        """Index of the token being generated (0 for the first): the counter of the random draws."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + generated), presence and frequency (generated) penalties, in place."""
    vocab = logits.shape[1]
    rep_rows, rep_cols, rep_vals = [], [], []
    cnt_rows, cnt_cols, freq, pres, cnt_row_ids = [], [], [], [], []
    for i, row in enumerate(rows):
        spec = row.spec
        if spec.repetition_penalty != 1.0:
            ids = list(row.token_ids)
            rep_rows.extend([i] * len(ids))
            rep_cols.extend(ids)
            rep_vals.append((i, spec.repetition_penalty))
        if spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0:
            generated = list(row.token_ids[row.num_prompt_tokens :])
            if generated:
                k = len(cnt_row_ids)
                cnt_row_ids.append(i)
                cnt_rows.extend([k] * len(generated))
                cnt_cols.extend(generated)
                freq.append(spec.frequency_penalty)
                pres.append(spec.presence_penalty)
    device = logits.device
    if rep_rows:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[device_tensor(rep_rows, torch.int64, device), device_tensor(rep_cols, torch.int64, device)] = True
        penalty = torch.ones(logits.shape[0], 1, dtype=logits.dtype, device=device)
        rep_idx = device_tensor([i for i, _ in rep_vals], torch.int64, device)
        penalty[rep_idx, 0] = device_tensor([p for _, p in rep_vals], logits.dtype, device)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if cnt_row_ids:
        counts = torch.zeros(len(cnt_row_ids), vocab, dtype=logits.dtype, device=device)
        ones = torch.ones(len(cnt_rows), dtype=logits.dtype, device=device)
        cells = (device_tensor(cnt_rows, torch.int64, device), device_tensor(cnt_cols, torch.int64, device))
        counts.index_put_(cells, ones, accumulate=True)
        f = device_tensor(freq, logits.dtype, device).unsqueeze(1)
        p = device_tensor(pres, logits.dtype, device).unsqueeze(1)
        idx = device_tensor(cnt_row_ids, torch.int64, device)
        logits[idx] -= f * counts + p * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each row's logit_bias added to its logits, in place (one scatter for the batch)."""
    r, c, bias = [], [], []
    for i, row in enumerate(rows):
        if row.spec.logit_bias:
            r.extend([i] * len(row.spec.logit_bias))
            c.extend(row.spec.logit_bias)
            bias.extend(row.spec.logit_bias.values())
    if r:
        device = logits.device
        cells = (device_tensor(r, torch.int64, device), device_tensor(c, torch.int64, device))
        logits.index_put_(cells, device_tensor(bias, logits.dtype, device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Until a request has generated min_tokens tokens, its stop token ids cannot be picked."""
    r, c = [], []
    for i, row in enumerate(rows):
        spec = row.spec
        if spec.stop_token_ids and row.output_index < spec.min_tokens:
            r.extend([i] * len(spec.stop_token_ids))
            c.extend(spec.stop_token_ids)
    if r:
        device = logits.device
        logits[device_tensor(r, torch.int64, device), device_tensor(c, torch.int64, device)] = float("-inf")


TOP_P_CANDIDATES = 256  # a row's top-p cut-off is looked for among its largest logits first (then 8x as many)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) what top-k and top-p exclude: each row keeps its logits >= a threshold (the smallest kept
    value; tokens tied with it are kept too, as the GPU's search keeps them). top_k 0 and top_p 1 leave a row
    untouched. No sort of the vocabulary: top-p's cut-off is found among each row's largest TOP_P_CANDIDATES
    logits (torch.topk, sorted), over probabilities normalised by the whole row's (or its top-k's) log-sum-exp,
    and looked for among 8x as many where some row's kept mass reaches past them (flat distributions). At 32 x
    49,152 on the 2-core development VM torch.topk of 256 takes 2.4 ms, a full sort 44.5 (docs/performance-history.md)."""
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
    whole_row = _logsumexp_rows(logits) if any(not 0 < kk < vocab for kk in top_k) else None
    width = min(vocab, max([TOP_P_CANDIDATES] + [kk for kk in top_k if 0 < kk < vocab]))
    while True:
        values = torch.topk(logits, width, dim=1).values.float()  # [n, width], largest first
        in_top_k = torch.arange(width, device=device).unsqueeze(0) < k
        candidates = values.masked_fill(~in_top_k, float("-inf"))
        normaliser = _logsumexp_rows(candidates)
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


def _logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, V] -> [n, 1] float32 log-sum-exp of each row, through _clamped_exp_ (torch.logsumexp's exp takes the
    slow path where the result underflows)."""
    top = x.max(dim=1, keepdim=True).values.float()
    return top + _clamped_exp_(x.float() - top).sum(dim=1, keepdim=True).log_()


def _uses_filters(rows: list[SamplingRow]) -> bool:
    return any(r.spec.top_k > 0 or r.spec.top_p < 1.0 or r.spec.min_p > 0.0 for r in rows)


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature-scaled logits -> the same with -inf where top-k, top-p or min-p exclude a token."""
    top_k = [r.spec.top_k for r in rows]
    top_p = [r.spec.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    min_p = [r.spec.min_p for r in rows]
    if any(m > 0.0 for m in min_p):
        # probs >= m * max(probs)  <=>  logit >= max(logit) + log(m)  (m = 0: log 0 = -inf, nothing dropped)
        log_m = torch.log(device_tensor(min_p, torch.float32, logits.device)).unsqueeze(1)
        logits = logits.masked_fill(logits < logits.max(dim=1, keepdim=True).values + log_m, float("-inf"))
    return logits


def _sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the seeded draw. Returns [n] int64 token ids."""
    if logits.is_cuda:
        return _sample_rows_gumbel(logits, rows)
    device = logits.device
    temps = device_tensor([r.spec.temperature for r in rows], torch.float32, device).unsqueeze(1)
    logits = logits.to(torch.float32, copy=True).div_(temps)  # (one new tensor: the steps below work in place)
    if _uses_filters(rows):
        logits = _filter(logits, rows)
    weights = _shifted_exp_(logits)  # unnormalised: the draw scales by the sum
    draws = device_tensor([uniform_draw(row_key(r.spec.seed, r.output_index)) for r in rows], torch.float64, device)
    return inverse_cdf(weights, draws)


# Weights at most this are set to 0: e^-87 (the clamp's value, float32's smallest normal range) with a margin over
# its rounding
_UNDERFLOW = math.exp(-87.0) * 1.001


def _shifted_exp_(logits: torch.Tensor) -> torch.Tensor:
    """In place: exp(logits - the row's max) (_clamped_exp_)."""
    return _clamped_exp_(logits.sub_(logits.max(dim=1, keepdim=True).values))


def _clamped_exp_(shifted: torch.Tensor) -> torch.Tensor:
    """In place: exp of values <= 0 (logits less their row's max), exactly 0 below -87 (e^-87 ~ 1.6e-38: weight
    nothing beside the row's largest, 1). torch's CPU exp takes a slow path for arguments whose result underflows:
    16-38x the time for those below -87 and 4x for -inf (the masked tokens), at 32 x 49,152 up to ~25 ms against
    0.7 (docs/performance-history.md); temperature-scaled logits of a confident model reach there. In place (and the zeros
    by a threshold rather than a mask): each new 6 MB tensor of that size is paid in page faults."""
    return torch.nn.functional.threshold_(shifted.clamp_(min=-87.0).exp_(), _UNDERFLOW, 0.0)


CDF_BLOCK = 256  # entries a block of the two-level inverse CDF


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """weights [n, V] >= 0 (some > 0 in each row, unnormalised), draws [n] float64 in (0, 1) -> [n] int64: per row
    the first index whose cumulative weight reaches draw x the row's total. In two levels: the blocks' sums
    (float32, 256 weights each) and their cumulative sum (float64) find the block, then that block's own cumulative
    sum (float64) the token: one pass over the weights instead of a float64 copy and a cumulative sum of the whole
    vocabulary (docs/performance-history.md). A token of weight 0 is never drawn: were the block's own sums to round below
    the draw, its last token of weight > 0 is taken."""
    n, vocab = weights.shape
    pad = (-vocab) % CDF_BLOCK
    blocks = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).view(n, -1, CDF_BLOCK)
    block_cdf = torch.cumsum(blocks.sum(2).double(), 1)  # [n, blocks]: float32 sums of 256, then float64
    u = (draws * block_cdf[:, -1]).unsqueeze(1)
    b = torch.searchsorted(block_cdf, u).clamp_(max=block_cdf.shape[1] - 1)  # [n, 1]: the first reaching u
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(u))
    inner = before + torch.cumsum(blocks.gather(1, b.unsqueeze(2).expand(n, 1, CDF_BLOCK)).squeeze(1).double(), 1)
    j = torch.searchsorted(inner, torch.minimum(u, inner[:, -1:])).squeeze(1)
    return (b.squeeze(1) * CDF_BLOCK + j).clamp_(max=vocab - 1)


SEARCH_TOP_K = False  # top-k without top-p through the cut-off search too (else torch.topk's k-th value)


def _sample_rows_gumbel(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The GPU draw: one Triton pass per row (kernels/sampling.py: Gumbel-max over hashed uniforms of the same
    per-row key). With top-p in the batch, top-k, top-p and min-p become one cut-off per row, searched without a
    sort (kernels/sampling_filter.py; ties at the cut-off are kept), which the draw applies as it reads the unscaled
    logits. Without top-p, top-k (torch.topk's k-th value) and min-p mask a scaled copy as before: that path never
    sorted, and it was as fast as the search for top-k 50 at batch 256 and faster at batch <= 32 (docs/performance-history.md;
    SEARCH_TOP_K sends top-k through the search instead)."""
    from shardserve.kernels.sampling import gumbel_sample
    from shardserve.kernels.sampling_filter import filter_thresholds, filter_thresholds_ref

    device = logits.device
    vocab = logits.shape[1]
    search = any(r.spec.top_p < 1.0 or (SEARCH_TOP_K and 0 < r.spec.top_k < vocab) for r in rows)
    # one copy to the device: 1 / temperature, then (searching) top-k (0: off), top-p, min-p
    params = [1.0 / r.spec.temperature for r in rows]
    if search:
        params += [float(r.spec.top_k if 0 < r.spec.top_k < vocab else 0) for r in rows]
        params += [r.spec.top_p for r in rows] + [r.spec.min_p for r in rows]
    params = device_tensor(params, torch.float32, device).view(-1, len(rows))
    inv_temps, thresholds = params[0], None
    if search:
        if logits.is_cuda:  # (no row with a top-k: the count search's launches are left out)
            thresholds = filter_thresholds(logits, inv_temps, params[1], params[2], params[3],
                                           count_search=any(0 < r.spec.top_k < vocab for r in rows))
        else:  # CPU: the tests of this path
            thresholds = filter_thresholds_ref(logits, inv_temps, params[1], params[2], params[3])
    elif _uses_filters(rows):
        logits = _filter(logits * inv_temps.unsqueeze(1), rows)
        inv_temps = torch.ones_like(inv_temps)
    # the keys' host work runs while the device searches the cut-offs
    keys = device_tensor(row_keys_split([r.spec.seed for r in rows], [r.output_index for r in rows]), torch.int64,
                         device)
    return gumbel_sample(logits, keys.view(-1, 2), inv_temps, thresholds)


def token_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprobs | None]:
    """The sampled tokens' logprobs and the top N of each row that asked (None elsewhere). Reads back to the host."""
    wanted = [i for i, r in enumerate(rows) if r.spec.logprobs >= 0]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    idx = torch.tensor(wanted, device=raw_logits.device)
    found = logprobs_of(raw_logits[idx], tokens[idx], [rows[i].spec.logprobs for i in wanted])
    for i, entry in zip(wanted, found):
        out[i] = entry
    return out


def logprobs_of(raw_logits: torch.Tensor, targets: torch.Tensor, top_n: list[int]) -> list[TokenLogprobs]:
    """Row i: the logprob and rank of token targets[i] under log_softmax(raw_logits[i]) (float32), and its top
    top_n[i] tokens. Reads back to the host."""
    logp = torch.log_softmax(raw_logits.float(), dim=1)
    chosen_t = logp.gather(1, targets.long().unsqueeze(1))
    ranks = ((logp > chosen_t).sum(dim=1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    n_max = max(top_n)
    top_vals, top_ids = (logp.topk(n_max, dim=1) if n_max > 0 else (logp[:, :0], logp[:, :0].long()))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(logprob=chosen[j], top_ids=top_ids[j][:n], top_logprobs=top_vals[j][:n], rank=ranks[j])
        for j, n in enumerate(top_n)
    ]


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits: [N, V] (full vocabulary, any float dtype), one row per SamplingRow. Returns one token (and logprobs)
    per row."""
    tokens = sample_tokens(logits, rows)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=token_logprobs(logits, rows, tokens))


@torch.inference_mode()
def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """sample() without reading back: [N] int64 token ids on the logits' device (async scheduling feeds them to
    the next step there). Leaves `logits` unchanged, so token_logprobs can read them afterwards."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    if any(_edits_logits(r) for r in rows):  # bias, penalties and min_tokens write in place: on a float32 copy
        logits = logits.to(torch.float32, copy=True)
        apply_logit_bias(logits, rows)
        apply_penalties(logits, rows)
        apply_min_tokens(logits, rows)
    sampled = [i for i, r in enumerate(rows) if r.spec.temperature > 0.0]
    if len(sampled) == len(rows):
        tokens = _sample_rows(logits, rows)
    else:
        tokens = greedy(logits)
        if sampled:
            idx = device_tensor(sampled, torch.int64, logits.device)
            tokens[idx] = _sample_rows(logits[idx], [rows[i] for i in sampled])
    return tokens


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[n] int64: each row's argmax (the first index of its largest value, as torch.argmax). On the CPU through
    torch.max, whose indices are the same and which runs ~5x faster on bfloat16 logits (2.56 against 0.54 ms at
    32 x 49,152 on the development VM)."""
    if logits.device.type == "cpu":
        return torch.max(logits, dim=1).indices
    return torch.argmax(logits, dim=1)


def plain_greedy(rows: list[SamplingRow]) -> bool:
    """Every row takes the argmax of its raw logits: temperature 0 and nothing that edits the logits first (what
    sample_tokens would do is then torch.argmax alone)."""
    return all(r.spec.temperature == 0.0 and not _edits_logits(r) for r in rows)


def uses_penalties(spec: SamplingSpec) -> bool:
    """Repetition, presence or frequency penalty: the row's token values are needed (on the host)."""
    return spec.repetition_penalty != 1.0 or spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0


def _edits_logits(row: SamplingRow) -> bool:
    spec = row.spec
    return (bool(spec.logit_bias) or uses_penalties(spec)
            or (bool(spec.stop_token_ids) and row.output_index < spec.min_tokens))


# One spec per compiled variant of the GPU sampler's kernels (kernels/sampling.py, sampling_filter.py): no filter,
# the cut-off search with and without its count search, top-k and min-p by masks; penalties on a float32 copy.
_WARM_SPECS = (SamplingSpec(temperature=1.0), SamplingSpec(temperature=1.0, top_p=0.9),
               SamplingSpec(temperature=1.0, top_k=50, top_p=0.9), SamplingSpec(temperature=1.0, top_k=50),
               SamplingSpec(temperature=1.0, min_p=0.1), SamplingSpec(temperature=1.0, repetition_penalty=1.1))


@torch.inference_mode()
def warm_up(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the GPU sampler's kernel variants at start-up instead of in the first step that meets each one: cold
    (no Triton cache on disk), the first offline step took 0.4-0.7 s more than warm, ~9% of a 6.8 s run on an H200
    (docs/performance-history.md). Nothing to do on CPU, which compiles nothing."""
    if device.type != "cuda":
        return
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    for spec in _WARM_SPECS:
        sample_tokens(logits, [SamplingRow(spec, [0, 1], 1)] * 2)
    torch.cuda.synchronize(device)
