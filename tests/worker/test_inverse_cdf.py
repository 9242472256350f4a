"""The CPU draw's two-level inverse CDF (worker/cpu_draw.inverse_cdf) against a cumulative sum of the whole row."""

from __future__ import annotations

import torch

from shardserve.worker.cpu_draw import CDF_BLOCK, inverse_cdf


def test_the_two_level_inverse_cdf_is_the_whole_vocabularys():
    """worker/cpu_draw.inverse_cdf (block sums, then one block's cumulative sum) draws what a cumulative sum over the
    whole row does, across block edges and a ragged last block, and never a token of weight 0."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 2000, 3 * CDF_BLOCK + 77
    weights = torch.rand(n, vocab, generator=gen) ** 8  # most of the mass in a few tokens a row
    weights[:, CDF_BLOCK - 5: 2 * CDF_BLOCK + 9] = 0.0  # a run of zeros over a whole block and two block edges
    weights[:100, :-1] = 0.0  # rows whose only token is the very last
    draws = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    cdf = torch.cumsum(weights.double(), 1)
    want = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    got = inverse_cdf(weights, draws)
    assert (got == want).float().mean() > 0.999, (got != want).nonzero()[:5]
    assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all())
    assert bool((got[:100] == vocab - 1).all())
