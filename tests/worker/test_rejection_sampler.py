"""Speculative sampling keeps the target's distribution: sequences generated through rejection_sample, with drafts
from a distribution q that differs from the target p, have p's distribution at every position (a chi-square
test per position at significance 0.001); accepting every draft unconditionally (the planted bug) gives q's
instead, and the same test rejects it. Fixed seeds: the test is deterministic."""

from __future__ import annotations

import torch

from shardserve.worker.rejection_sampler import rejection_sample

V, K, LENGTH, N = 6, 2, 4, 4000
SIGNIFICANCE = 1e-3


def _distributions(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(LENGTH + K + 1, V, generator=g, dtype=torch.float64), dim=1)


TARGET, DRAFT = _distributions(1), _distributions(2)  # p and q at each position of a sequence


def generate(unconditional: bool = False) -> torch.Tensor:
    """[N, LENGTH] tokens: each step drafts K tokens from q at the next positions, then rejection_sample."""
    g = torch.Generator().manual_seed(0)
    out = torch.full((N, LENGTH), -1, dtype=torch.int64)
    pos = torch.zeros(N, dtype=torch.int64)
    while bool((pos < LENGTH).any()):
        at = (pos.unsqueeze(1) + torch.arange(K + 1)).clamp(max=LENGTH + K)  # drafts and the bonus (rows done: any)
        p, q = TARGET[at], DRAFT[at[:, :K]]
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(N, K)
        accept_u = torch.rand(N, K, generator=g, dtype=torch.float64)
        if unconditional:
            accept_u = torch.zeros_like(accept_u)  # u * q <= p always: every draft kept
        accepted, emitted = rejection_sample(p, q, drafts, accept_u, torch.rand(N, generator=g, dtype=torch.float64))
        for row in range(N):
            start, a = int(pos[row]), int(accepted[row])
            tokens = drafts[row, :a].tolist() + [int(emitted[row])]
            for i, token in enumerate(tokens):
                if start + i < LENGTH:
                    out[row, start + i] = token
            pos[row] = start + a + 1
    return out


def p_values(tokens: torch.Tensor) -> list[float]:
    """Per position, the chi-square test's p-value of the tokens against the target distribution there."""
    values = []
    for position in range(LENGTH):
        counts = torch.bincount(tokens[:, position], minlength=V).double()
        expected = N * TARGET[position]
        stat = float(((counts - expected) ** 2 / expected).sum())
        values.append(float(torch.special.gammaincc(torch.tensor((V - 1) / 2), torch.tensor(stat / 2))))
    return values


def test_rejection_sampling_keeps_the_target_distribution_at_every_position():
    assert float((TARGET[:LENGTH] - DRAFT[:LENGTH]).abs().sum(1).min()) > 0.3  # the draft really differs
    assert min(p_values(generate())) > SIGNIFICANCE


def test_accepting_every_draft_fails_the_same_test():
    assert min(p_values(generate(unconditional=True))) < SIGNIFICANCE


def test_a_draft_equal_to_the_target_is_always_accepted_and_a_point_mass_draft_with_p_x():
    p = TARGET[: K + 1].unsqueeze(0).expand(3, -1, -1)
    drafts = torch.tensor([[0, 1], [2, 3], [4, 5]])
    accepted, _ = rejection_sample(p, p[:, :K], drafts, torch.full((3, K), 0.999999, dtype=torch.float64),
                                   torch.full((3,), 0.5, dtype=torch.float64))
    assert accepted.tolist() == [K] * 3
    # a point mass at x: accepted iff u <= p(x); rejected, the residual is p without x
    point = torch.nn.functional.one_hot(drafts, V).double()
    u = TARGET[0, 0].item()
    accepted, emitted = rejection_sample(p[:1], point[:1], drafts[:1], torch.tensor([[u * 1.01, 0.5]]),
                                         torch.tensor([0.999999], dtype=torch.float64))
    assert accepted.item() == 0 and emitted.item() != 0
