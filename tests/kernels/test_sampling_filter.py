"""The sort-free top-k/top-p/min-p cut-off (kernels/sampling_filter.py): the same thresholds as its sorted torch
reference, the same kept set as the sampler's sort (worker/logit_filter.filter_top_k_top_p) where values are distinct,
every tied token kept, and the Gumbel draw never leaving the kept set. Interpreted on CPU: small vocabularies."""

import pytest
import torch

from shardserve.kernels.sampling import gumbel_sample, gumbel_sample_ref, split_keys
from shardserve.kernels.sampling_filter import filter_thresholds, filter_thresholds_ref
from shardserve.worker.logit_filter import filter_top_k_top_p

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


def _params(inv_t, top_k, top_p, min_p):
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=DEVICE)  # noqa: E731
    return f(inv_t), f(top_k), f(top_p), f(min_p)


SETTINGS = [  # (1 / T, top_k, top_p, min_p) per row
    (1.0, 0, 0.9, 0.0), (2.0, 0, 0.5, 0.0), (0.5, 50, 0.8, 0.0), (1.0, 5, 1.0, 0.0), (1.7, 0, 0.99, 0.1),
    (1.0, 1499, 0.3, 0.0), (1.3, 1, 0.9, 0.0), (0.9, 20, 1.0, 0.05), (1.0, 0, 1.0, 0.0), (1.0, 0, 0.01, 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thresholds_equal_the_sorted_reference(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(len(SETTINGS), 1500, device=DEVICE) * 3).to(dtype)  # 1500: the last 512-block part-full
    logits[1, 100:] = -INF  # a row restricted to its first 100 tokens (min_tokens-style masks)
    logits[5, ::2] = -INF  # fewer finite tokens than its top_k
    params = _params(*zip(*SETTINGS))
    got, want = filter_thresholds(logits, *params), filter_thresholds_ref(logits, *params)
    assert torch.equal(got, want), (got, want)
    assert got[8] == -INF  # no filter: every token kept


def test_kept_set_equals_the_sorts_where_values_are_distinct():
    torch.manual_seed(1)
    logits = torch.randn(len(SETTINGS), 1500, device=DEVICE) * 2  # float32: distinct values
    inv_t, top_k, top_p, min_p = _params(*zip(*SETTINGS))
    kept = logits * inv_t.unsqueeze(1) >= filter_thresholds(logits, inv_t, top_k, top_p, min_p).unsqueeze(1)
    sorted_kept = filter_top_k_top_p(logits * inv_t.unsqueeze(1), [int(k) for k in top_k.tolist()],
                                      top_p.tolist()) > -INF
    min_p_kept = logits * inv_t.unsqueeze(1) >= (logits * inv_t.unsqueeze(1)).max(1, keepdim=True).values \
        + torch.log(min_p).unsqueeze(1)
    assert torch.equal(kept, sorted_kept & min_p_kept)
    assert kept.sum(1).tolist()[6] == 1 and kept.sum(1).tolist()[3] == 5  # top_k 1 and 5


def test_tokens_tied_at_the_cut_off_are_all_kept():
    row = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], device=DEVICE)
    logits = row.expand(3, 6).contiguous()
    # top_k 2 cuts inside the 2.0s; top-p 0.7 needs mass beyond the 3.0 (0.60 of it); min-p alone cuts at 1.0
    params = _params([1.0] * 3, [2, 0, 0], [1.0, 0.7, 1.0], [0.0, 0.0, 0.3])
    thresholds = filter_thresholds(logits, *params)
    assert thresholds[:2].tolist() == [2.0, 2.0]
    kept = logits >= thresholds.unsqueeze(1)
    assert kept[0].tolist() == kept[1].tolist() == [True, True, True, True, False, False]
    assert kept[2].tolist() == [True, True, True, True, False, False]  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3


def test_top_p_after_top_k_renormalises_over_the_k_best():
    probs = torch.tensor([0.3, 0.2, 0.2, 0.1] + [0.2 / 16] * 16, device=DEVICE)
    logits = probs.log().unsqueeze(0)
    # top-k 3 keeps 0.3, 0.2, 0.2 (mass 0.7); top-p 0.6 of that is 0.42: 0.3 < 0.42 <= 0.5 -> the 0.2s stay
    thresholds = filter_thresholds(logits, *_params([1.0], [3], [0.6], [0.0]))
    assert (logits[0] >= thresholds[0]).nonzero().flatten().tolist() == [0, 1, 2]
    # top-p 0.4 of 0.7 is 0.28: the 0.3 alone reaches it
    thresholds = filter_thresholds(logits, *_params([1.0], [3], [0.4], [0.0]))
    assert (logits[0] >= thresholds[0]).nonzero().flatten().tolist() == [0]


def test_draw_with_thresholds_equals_reference_and_stays_in_the_kept_set():
    torch.manual_seed(2)
    logits = torch.randn(64, 700, device=DEVICE).to(torch.bfloat16)
    inv_t = torch.full((64,), 1.5, device=DEVICE)
    thresholds = filter_thresholds_ref(logits, *_params([1.5] * 64, [0] * 64, [0.5] * 64, [0.0] * 64))
    keys = torch.tensor(split_keys([977 * i + 13 for i in range(64)]), dtype=torch.int64, device=DEVICE).view(-1, 2)
    tokens = gumbel_sample(logits, keys, inv_t, thresholds)
    assert torch.equal(tokens, gumbel_sample_ref(logits, keys, inv_t, thresholds))
    chosen = logits.float().gather(1, tokens.unsqueeze(1)).squeeze(1) * 1.5
    assert torch.all(chosen >= thresholds)


def test_a_rows_threshold_depends_only_on_its_row():
    torch.manual_seed(3)
    logits = torch.randn(4, 600, device=DEVICE)
    params = _params([1.0, 0.5, 2.0, 1.0], [0, 7, 0, 30], [0.9, 0.95, 0.6, 0.8], [0.0, 0.0, 0.02, 0.0])
    full = filter_thresholds(logits, *params)
    alone = torch.stack([filter_thresholds(logits[i:i + 1], *(p[i:i + 1] for p in params))[0] for i in range(4)])
    assert torch.equal(full, alone)


@pytest.mark.parametrize("cap", [4, 64, 4096])
def test_thresholds_do_not_depend_on_the_compaction_capacity(cap, monkeypatch):
    """A part copies its entries in [lo, hi) once they fit `cap` slots and reads only those afterwards; 4 slots
    keeps almost every part scanning its chunk, 4096 copies whole parts at the first pass. Each gives the sort's
    cut-offs (float32 values: distinct, so the masses decide)."""
    from shardserve.kernels import sampling_filter

    monkeypatch.setattr(sampling_filter, "_CAP", cap)
    torch.manual_seed(4)
    logits = torch.randn(len(SETTINGS), 1500, device=DEVICE) * 3
    logits[2, :40] += 9.0  # a few tokens far above the rest
    params = _params(*zip(*SETTINGS))
    assert torch.equal(filter_thresholds(logits, *params), filter_thresholds_ref(logits, *params))


def test_thresholds_at_a_larger_vocabulary_equal_the_sorted_reference():
    """10,000 entries: 16 parts of 640 (the last 400), more than a part's buffer holds (512), so the search
    narrows with the pivots over whole chunks first, then copies [lo, hi) (bf16 rows: many tied values; flat rows,
    hot rows, peaked rows, top-k then top-p)."""
    torch.manual_seed(5)
    rows = [(1 / 0.7, 0, 0.9, 0.0), (0.5, 0, 0.95, 0.0), (1.0, 40, 0.9, 0.0), (2.0, 0, 0.5, 0.02),
            (1.0, 700, 1.0, 0.0), (0.8, 3000, 0.99, 0.0)]
    logits = torch.randn(len(rows), 10000, device=DEVICE) * 2
    logits[3, torch.randperm(10000)[:8]] = 14.0
    params = _params(*zip(*rows))
    for dtype in (torch.bfloat16, torch.float32):
        x = logits.to(dtype)
        assert torch.equal(filter_thresholds(x, *params), filter_thresholds_ref(x, *params)), dtype


def test_a_copy_that_overflows_its_buffer_falls_back_to_scanning_the_chunk(monkeypatch):
    """Parts told that up to 10,000 entries fit while their buffer holds 8: every copy overflows, and the part must
    scan its whole chunk with the pivots in that same pass (no entry lost, no stale buffer read afterwards)."""
    from shardserve.kernels import sampling_filter

    monkeypatch.setattr(sampling_filter, "_CAP", 8)
    monkeypatch.setattr(sampling_filter, "_FIT", 10000)
    torch.manual_seed(6)
    logits = torch.randn(len(SETTINGS), 1500, device=DEVICE) * 3
    params = _params(*zip(*SETTINGS))
    assert torch.equal(filter_thresholds(logits, *params), filter_thresholds_ref(logits, *params))
