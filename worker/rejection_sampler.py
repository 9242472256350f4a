"""Speculative sampling's rejection step for drafts drawn from a distribution q (a draft model's), which keeps
the target's distribution p exactly (Leviathan et al. 2023; Chen et al. 2023):

    for each draft position i in order: accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i));
    at the first rejection, emit a token drawn from the residual max(0, p_i - q_i), normalised, and stop;
    if all k drafts are accepted, emit a bonus token drawn from p_k.

Each emitted token is then distributed as p at its position: P(x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
= min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x).

The uniforms come from the caller, so draws stay a pure function of (seed, token index) as everywhere in the
sampler (worker/sampler.py): a seeded request is reproducible whatever else is batched. An n-gram draft is the
point mass q = 1 at x, for which worker/spec_verify.py uses the equivalent coupled form (sample y ~ p, accept iff
y == x) that also reproduces decoding without speculation token for token.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,  # [n, k + 1, V] p at each draft position and the bonus position
    draft_probs: torch.Tensor,  # [n, k, V] q at each draft position
    draft_tokens: torch.Tensor,  # [n, k] int64, x_i ~ q_i
    accept_uniforms: torch.Tensor,  # [n, k] in (0, 1)
    draw_uniforms: torch.Tensor,  # [n] in (0, 1): the draw at the first rejection (or the bonus)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [n] int64: drafts kept per row, 0..k; emitted [n] int64: the token after them)."""
    n, k = draft_tokens.shape
    rows = torch.arange(n, device=draft_tokens.device)
    p_x = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    q_x = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    accept = accept_uniforms * q_x <= p_x  # u < min(1, p/q), without dividing
    accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # leading accepted drafts
    at = accepted.clamp(max=k - 1) if k else accepted
    p_at = target_probs[rows, accepted]  # [n, V]: p at the first rejected position, or the bonus position
    residual = (p_at - draft_probs[rows, at]).clamp_(min=0.0) if k else p_at
    residual = torch.where((accepted < k).unsqueeze(1), residual, p_at)
    mass = residual.sum(dim=1, keepdim=True)
    residual = torch.where(mass > 0, residual, p_at)  # p == q there: no rejection was possible; p itself
    cdf = residual.double().cumsum(dim=1)
    u = (draw_uniforms.double() * cdf[:, -1]).unsqueeze(1)
    emitted = torch.searchsorted(cdf, u).squeeze(1).clamp_(max=residual.shape[1] - 1)
    return accepted, emitted
