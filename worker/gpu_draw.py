"""The GPU draw: Gumbel-max over hashed uniforms of each row's (seed, index) key (kernels/sampling.py), with the
top-k/top-p/min-p cut-offs searched without a sort where top-p is in the batch (kernels/sampling_filter.py)."""

from __future__ import annotations

import torch

from shardserve.worker.device_copy import device_tensor
from shardserve.worker.logit_filter import filter_logits, uses_filters
from shardserve.worker.sampling_keys import row_keys_split
from shardserve.worker.sampling_row import SamplingRow

SEARCH_TOP_K = False  # top-k without top-p through the cut-off search too (else torch.topk's k-th value)


def draw_rows_gumbel(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The GPU draw: one Triton pass per row (kernels/sampling.py: Gumbel-max over hashed uniforms of the same
    per-row key). With top-p in the batch, top-k, top-p and min-p become one cut-off per row, searched without a
    sort (kernels/sampling_filter.py; ties at the cut-off are kept), which the draw applies as it reads the unscaled
    logits. Without top-p, top-k (torch.topk's k-th value) and min-p mask a scaled copy as before: that path never
    sorted, and it was as fast as the search for top-k 50 at batch 256 and faster at batch <= 32
    (docs/performance-history.md; SEARCH_TOP_K sends top-k through the search instead)."""
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
    elif uses_filters(rows):
        logits = filter_logits(logits * inv_temps.unsqueeze(1), rows)
        inv_temps = torch.ones_like(inv_temps)
    # the keys' host work runs while the device searches the cut-offs
    keys = device_tensor(row_keys_split([r.spec.seed for r in rows], [r.output_index for r in rows]), torch.int64,
                         device)
    return gumbel_sample(logits, keys.view(-1, 2), inv_temps, thresholds)
