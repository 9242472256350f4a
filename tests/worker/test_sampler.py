"""The sampler: greedy, filters, seeded reproducibility, the distribution it draws from, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from shardserve.proto.plan import SamplingSpec
from shardserve.worker.logit_processors import apply_logit_bias, apply_min_tokens, apply_penalties
from shardserve.worker.sampler import sample
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.sampling_keys import row_key, splitmix64, uniform_draw


@pytest.fixture(autouse=True, params=["inverse-cdf", "gumbel"])
def draw_path(request, monkeypatch):
    """Every test runs on both draws: the CPU one (inverse CDF) and the CUDA one (Gumbel-max over hashed
    uniforms, worker/gpu_draw.draw_rows_gumbel), the latter with its torch reference in place of the kernel."""
    if request.param == "gumbel":
        from shardserve.kernels import sampling as kernels
        from shardserve.worker import gpu_draw, sampler

        monkeypatch.setattr(sampler, "draw_rows", gpu_draw.draw_rows_gumbel)
        monkeypatch.setattr(kernels, "gumbel_sample", kernels.gumbel_sample_ref)
    return request.param


def _row(prompt=(1, 2, 3), generated=(), **spec) -> SamplingRow:
    return SamplingRow(spec=SamplingSpec(**spec), token_ids=list(prompt) + list(generated), num_prompt_tokens=len(prompt))


def _rows_with_seeds(n: int, **spec) -> list[SamplingRow]:
    return [_row(seed=s, **spec) for s in range(n)]


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [_row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_maxima_as_argmax(dtype):
    """Ties are common in bfloat16 logits: the first index of the largest value, as torch.argmax (NaN rows too)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (64, 1000), generator=g).to(dtype)  # many ties at the maximum
    logits[5, 7] = float("nan")
    out = sample(logits, [_row(temperature=0.0) for _ in range(64)])
    assert out.token_ids == torch.argmax(logits, dim=1).tolist()
    assert out.token_ids[5] == 7 and all(logits[i, out.token_ids[i]] == 2 for i in range(64) if i != 5)


def test_draw_is_the_top_52_bits_of_the_splitmix64_key_and_inside_0_1():
    keys = [0, 1, 2**63 - 1, 2**64 - 1, row_key(12345, 7)]
    for key in keys:
        assert uniform_draw(key) == ((key >> 12) + 0.5) / 2**52
        assert 0.0 < uniform_draw(key) < 1.0
    assert row_key(12345, 7) == splitmix64(splitmix64(12345) ^ 7)


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf"), 0.0]]).repeat(500, 1)
    out = sample(logits, _rows_with_seeds(500, temperature=1.0))
    assert set(out.token_ids) == {0, 2, 4}


def test_top_k_never_emits_a_token_outside_the_k_best():
    logits = torch.linspace(3.0, 0.0, 40).repeat(300, 1)  # token 0 best, distinct values
    out = sample(logits, _rows_with_seeds(300, temperature=5.0, top_k=4))
    assert set(out.token_ids) <= {0, 1, 2, 3}
    assert set(out.token_ids) == {0, 1, 2, 3}  # a flat-ish distribution: all four are reached


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.4, 0.3, 0.2] + [0.1 / 17] * 17)
    logits = probs.log().repeat(400, 1)
    out = sample(logits, _rows_with_seeds(400, temperature=1.0, top_p=0.8))
    # mass before token 2 is 0.7 < 0.8 (kept); before token 3 it is 0.9 (dropped).
    assert set(out.token_ids) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().repeat(400, 1)
    out = sample(logits, _rows_with_seeds(400, temperature=1.0, min_p=0.3))  # keeps p >= 0.15
    assert set(out.token_ids) == {0, 1}


def test_filters_apply_per_row_in_a_mixed_batch():
    logits = torch.linspace(3.0, 0.0, 30).repeat(200, 1)
    rows = [_row(seed=s, temperature=5.0, top_k=2 if s % 2 else 0) for s in range(200)]
    out = sample(logits, rows)
    limited = {t for s, t in enumerate(out.token_ids) if s % 2}
    free = {t for s, t in enumerate(out.token_ids) if not s % 2}
    assert limited <= {0, 1}
    assert len(free) > 5  # the rows without top-k were not filtered by their neighbours' setting


def test_seeded_rows_are_reproducible_whatever_the_batch():
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(64, generator=gen) for _ in range(3))
    row_a = _row(seed=11, temperature=1.0, generated=(5, 6))
    row_b = _row(seed=22, temperature=0.8, top_p=0.9)
    row_c = _row(seed=33, temperature=0.0)
    alone = sample(a.unsqueeze(0), [row_a]).token_ids[0]
    batch = sample(torch.stack([b, a, c]), [row_b, row_a, row_c]).token_ids
    reordered = sample(torch.stack([c, a]), [row_c, row_a]).token_ids
    assert batch[1] == alone and reordered[1] == alone
    assert sample(b.unsqueeze(0), [row_b]).token_ids[0] == batch[0]


def test_draws_depend_on_seed_and_token_index():
    logits = torch.zeros(200, 1000)  # uniform: any token may come out
    by_seed = sample(logits, _rows_with_seeds(200, temperature=1.0)).token_ids
    by_index = sample(logits, [_row(seed=5, temperature=1.0, generated=[0] * i) for i in range(200)]).token_ids
    assert len(set(by_seed)) > 150 and len(set(by_index)) > 150


def test_empirical_distribution_matches_probs():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    n = 4000
    logits = probs.log().repeat(n, 1)
    tokens = sample(logits, _rows_with_seeds(n, temperature=1.0)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts.tolist())  # 7 degrees of freedom, p = 0.001


def test_temperature_sharpens_the_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(2000, 1)
    cold = sample(logits, _rows_with_seeds(2000, temperature=0.25)).token_ids
    share_best = cold.count(0) / 2000
    expected = 0.4**4 / sum(p**4 for p in (0.4, 0.3, 0.2, 0.1))  # softmax(log p / 0.25) = p^4 normalized
    assert abs(share_best - expected) < 0.04


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    row = _row(prompt=(0,), generated=(1,), repetition_penalty=2.0)
    apply_penalties(logits, [row])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 5)
    row = _row(prompt=(4, 4), generated=(1, 1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [row])
    assert logits.tolist() == [[0.0, -(0.5 + 0.75), -(0.5 + 0.25), 0.0, 0.0]]


def test_penalties_leave_rows_without_them_untouched():
    logits = torch.ones(2, 5)
    apply_penalties(logits, [_row(generated=(1,)), _row(generated=(1,), repetition_penalty=2.0, presence_penalty=1.0)])
    assert logits[0].tolist() == [1.0] * 5
    assert logits[1].tolist() == [1.0, -0.5, 0.5, 0.5, 1.0]


def test_min_tokens_blocks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 9.0, 1.0]]).repeat(2, 1)
    early = _row(generated=(3,), min_tokens=2, stop_token_ids=[2])
    due = _row(generated=(3, 3), min_tokens=2, stop_token_ids=[2])
    blocked = logits.clone()
    apply_min_tokens(blocked, [early, due])
    assert blocked[0, 2].item() == -math.inf and blocked[1, 2].item() == 9.0
    assert sample(logits, [early, due]).token_ids == [3, 2]


def test_logit_bias_is_added_per_row_before_the_penalties():
    """Each row's bias lands on its own tokens (one scatter for the batch); the repetition penalty then divides
    the biased logit; greedy and sampled rows pick by the biased logits; logprobs stay the raw log-softmax."""
    logits = torch.tensor([[2.0, 0.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0]])
    biased = logits.clone()
    rows = [_row(logit_bias={1: 3.0, 3: -1.5}), _row(), _row(logit_bias={0: -0.5})]
    apply_logit_bias(biased, rows)
    assert biased.tolist() == [[2.0, 3.0, 1.0, -1.5], [2.0, 0.0, 1.0, 0.0], [1.5, 0.0, 1.0, 0.0]]
    penalized = _row(prompt=(1,), logit_bias={1: 3.0}, repetition_penalty=2.0, temperature=0.0, logprobs=0)
    out = sample(logits[:1].clone(), [penalized])
    assert out.token_ids == [0]  # (0 + 3) / 2 = 1.5 < 2: the penalty applies to the biased logit
    assert abs(out.logprobs[0].logprob - torch.log_softmax(logits[0], 0)[0].item()) < 1e-6
    forced = [_row(seed=s, temperature=1.0, top_p=0.5, logit_bias={3: 100.0}) for s in range(8)]
    banned = [_row(seed=s, temperature=1.0, logit_bias={0: -100.0, 2: -100.0}) for s in range(8)]
    assert sample(logits.repeat(3, 1)[:8], forced).token_ids == [3] * 8
    assert set(sample(logits.repeat(3, 1)[:8], banned).token_ids) <= {1, 3}
    assert sample(logits[:2].clone(), [_row(logit_bias={2: 1.5}), _row()]).token_ids == [2, 0]


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    rows = [
        _row(seed=1, temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=3),
        _row(temperature=0.0, logprobs=0),
        _row(temperature=0.0),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, dim=1)
    first = out.logprobs[0]
    assert abs(first.logprob - ref[0, out.token_ids[0]].item()) < 1e-6
    assert first.top_ids == ref[0].topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(first.top_logprobs), ref[0].topk(3).values, atol=1e-6)
    assert out.logprobs[1].top_ids == [] and abs(out.logprobs[1].logprob - ref[1].max().item()) < 1e-6
    assert out.logprobs[2] is None


def test_rows_without_top_p_keep_their_whole_tail_next_to_rows_with_it():
    """In a batch where another row asks for top-p, a row with top_p 1.0 keeps every token, even where its float32
    running sum of sorted probabilities rounds up to 1 before the end of the vocabulary."""
    from shardserve.worker import logit_filter

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5000, generator=gen) * 3
    filtered = logit_filter.filter_top_k_top_p(logits, [0, 0], [0.5, 1.0])
    assert int(torch.isfinite(filtered[0]).sum()) < 100
    assert torch.equal(filtered[1], logits[1])


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The filter as one sort of the whole vocabulary (what the sampler did before its partial search): kept set
    of each row, for distinct values."""
    vocab = logits.shape[1]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k]).unsqueeze(1)
    p = torch.tensor(top_p).unsqueeze(1)
    sorted_logits, order = torch.sort(logits.float(), dim=1, descending=True)
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab).unsqueeze(0) >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=1)
    drop = ((torch.cumsum(probs, dim=1) - probs) >= p) & (p < 1.0)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, ~drop & (sorted_logits > float("-inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_without_a_sort_keeps_what_the_sort_keeps(dtype):
    """The partial search's kept set equals a full sort's, including rows whose nucleus reaches past the first
    TOP_P_CANDIDATES logits (a flat row: the search widens) and rows with a top-k beside their top-p."""
    from shardserve.worker import logit_filter

    gen = torch.Generator().manual_seed(5)
    vocab = 5000
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[1] = torch.randn(vocab, generator=gen) * 0.01  # flat: top-p 0.9 keeps ~4,500 tokens
    logits[4, 50:] = float("-inf")  # a masked row (min_tokens-style): 50 finite tokens
    logits = logits.to(dtype)
    top_k, top_p = [0, 0, 40, 3000, 0, 0], [0.9, 0.9, 0.8, 0.95, 0.99, 1.0]
    kept = torch.isfinite(logit_filter.filter_top_k_top_p(logits, top_k, top_p))
    by_sort = _sorted_top_k_top_p(logits, top_k, top_p)
    if dtype == torch.float32:  # distinct values: the same set
        assert torch.equal(kept, by_sort)
    else:  # bfloat16 rounds many values together: the sort's set, plus the tokens tied with its smallest value
        smallest = logits.float().masked_fill(~by_sort, float("inf")).amin(1, keepdim=True)
        assert torch.equal(kept, by_sort | (logits.float() == smallest))
        assert (kept & ~by_sort).any()  # (ties do occur here)
    assert kept[1].sum() > 8 * logit_filter.TOP_P_CANDIDATES and kept[5].all()  # widened; untouched
    assert kept[2].sum() <= 40 and kept[4].sum() <= 50


def test_top_p_keeps_every_token_tied_at_its_cut_off():
    from shardserve.worker import logit_filter

    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])  # top-p 0.7: past the 3.0 (0.60), into the 2.0s
    assert torch.isfinite(logit_filter.filter_top_k_top_p(logits, [0], [0.7]))[0].tolist() == [True] * 4 + [False] * 2


def test_draw_weights_are_exp_of_the_shift_and_exactly_zero_past_float32s_normal_range():
    from shardserve.worker import cpu_draw

    logits = torch.tensor([[10.0, -40.0, -76.9, -77.5, -190.0, float("-inf")]])  # shifted by the max, 10
    weights = cpu_draw.shifted_exp_(logits.clone())
    expected = torch.tensor([[1.0, math.exp(-50.0), math.exp(-86.9), 0.0, 0.0, 0.0]])
    assert torch.allclose(weights, expected, rtol=1e-4, atol=0.0) and (weights[0, 3:] == 0).all()


def test_row_keys_split_equals_row_key_per_row():
    """The vectorised keys (numpy's wrapping uint64) are row_key's, as the Gumbel kernel's 32-bit halves."""
    from shardserve.kernels.sampling import split_keys
    from shardserve.worker.sampling_keys import row_keys_split

    seeds = [0, 1, 12345, 2**63 - 1, 2**64 - 1, 977 * 31]
    rows = [SamplingRow(SamplingSpec(temperature=1.0, seed=s), [7] * (3 + i), 2) for i, s in enumerate(seeds)]
    assert row_keys_split([r.spec.seed for r in rows], [r.output_index for r in rows]) == split_keys(
        [row_key(r.spec.seed, r.output_index) for r in rows])
