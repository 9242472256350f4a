"""The CPU draw: temperature, the filters, then one uniform per row (from its (seed, index) key) and the first
token whose cumulative probability reaches it, found through a two-level inverse CDF."""

from __future__ import annotations

import torch

from shardserve.worker.device_copy import device_tensor
from shardserve.worker.logit_filter import clamped_exp_, filter_logits, uses_filters
from shardserve.worker.sampling_keys import row_key, uniform_draw
from shardserve.worker.sampling_row import SamplingRow

CDF_BLOCK = 256  # entries a block of the two-level inverse CDF


def draw_rows_cpu(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the seeded draw. Returns [n] int64 token ids."""
    device = logits.device
    temps = device_tensor([r.spec.temperature for r in rows], torch.float32, device).unsqueeze(1)
    logits = logits.to(torch.float32, copy=True).div_(temps)  # (one new tensor: the steps below work in place)
    if uses_filters(rows):
        logits = filter_logits(logits, rows)
    weights = shifted_exp_(logits)  # unnormalised: the draw scales by the sum
    draws = device_tensor([uniform_draw(row_key(r.spec.seed, r.output_index)) for r in rows], torch.float64, device)
    return inverse_cdf(weights, draws)


def shifted_exp_(logits: torch.Tensor) -> torch.Tensor:
    """In place: exp(logits - the row's max) (clamped_exp_)."""
    return clamped_exp_(logits.sub_(logits.max(dim=1, keepdim=True).values))


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """weights [n, V] >= 0 (some > 0 in each row, unnormalised), draws [n] float64 in (0, 1) -> [n] int64: per row
    the first index whose cumulative weight reaches draw x the row's total. In two levels: the blocks' sums
    (float32, 256 weights each) and their cumulative sum (float64) find the block, then that block's own cumulative
    sum (float64) the token: one pass over the weights instead of a float64 copy and a cumulative sum of the whole
    vocabulary (docs/performance-history.md). A token of weight 0 is never drawn: were the block's own sums to
    round below the draw, its last token of weight > 0 is taken."""
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
