"""What edits a row's logits before the draw, in place, in vLLM/HF order: logit_bias (added), repetition penalty
(prompt + generated tokens), presence/frequency penalties (generated tokens), min_tokens (stop ids masked)."""

from __future__ import annotations

import torch

from shardserve.proto.plan import SamplingSpec
from shardserve.worker.device_copy import device_tensor
from shardserve.worker.sampling_row import SamplingRow


def uses_penalties(spec: SamplingSpec) -> bool:
    """Repetition, presence or frequency penalty: the row's token values are needed (on the host)."""
    return spec.repetition_penalty != 1.0 or spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0


def edits_logits(row: SamplingRow) -> bool:
    """Some processor below changes this row's logits."""
    spec = row.spec
    return (bool(spec.logit_bias) or uses_penalties(spec)
            or (bool(spec.stop_token_ids) and row.output_index < spec.min_tokens))


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits with every row's bias, penalties and min_tokens applied: a float32 copy where some row edits
    them (the processors write in place), else `logits` itself."""
    if not any(edits_logits(r) for r in rows):
        return logits
    logits = logits.to(torch.float32, copy=True)
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    apply_min_tokens(logits, rows)
    return logits


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
