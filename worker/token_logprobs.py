"""Logprobs of the sampled tokens and each row's top N, from the raw logits (before any processor or filter)."""

from __future__ import annotations

import torch

from shardserve.proto.plan import TokenLogprobs
from shardserve.worker.sampling_row import SamplingRow


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
