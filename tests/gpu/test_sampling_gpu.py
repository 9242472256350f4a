"""GPU suite: the sort-free top-k/top-p/min-p cut-off and the sampler at the Qwen3 vocabulary (151,936) and batch 256:
the kept sets equal the sorted reference's (exactly for counts; for masses, except where the reference's cumulative
mass at the cut-off is within float rounding of p), the draws stay in them, follow the renormalised distribution,
and depend only on (logits, seed, token index). Runs only on a CUDA host (make test-gpu)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from shardserve.kernels import sampling_filter  # noqa: E402
from shardserve.kernels.sampling_filter import filter_thresholds, filter_thresholds_ref  # noqa: E402
from shardserve.proto.plan import SamplingSpec  # noqa: E402
from shardserve.worker import gpu_draw  # noqa: E402
from shardserve.worker.sampler import sample_tokens  # noqa: E402
from shardserve.worker.sampling_row import SamplingRow  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 151936
TOLERANCE = 1e-5  # relative: the float32 mass sums' rounding over a 152k row, with room


def _logits(rows: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Half the rows plain noise (a flat tail), half LLM-like: a few tokens far above the rest."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen) * 2
    peaks = torch.randint(0, VOCAB, (rows, 8), device="cuda", generator=gen)
    logits[::2].scatter_(1, peaks[::2], 12.0 + 3 * torch.rand(rows, 8, device="cuda", generator=gen)[::2])
    return logits.to(dtype)


def _check_against_sort(logits, inv_t, top_k, top_p, min_p):
    got = filter_thresholds(logits, inv_t, top_k, top_p, min_p)
    want = filter_thresholds_ref(logits, inv_t, top_k, top_p, min_p)
    x = (logits.float() * inv_t.unsqueeze(1)).double()  # the kernel's float32 product, then exact sums
    k_cut = filter_thresholds_ref(logits, inv_t, top_k, torch.ones_like(top_p), torch.zeros_like(min_p))
    w = torch.exp(x - x.max(1, keepdim=True).values) * (x >= k_cut.double().unsqueeze(1))
    goal = top_p.double() * w.sum(1)
    differs = got != want
    for r in differs.nonzero().flatten().tolist():
        # a mismatch is allowed only where the cut-off's mass is within rounding of p (both sides stay valid)
        assert top_p[r] < 1.0, (r, got[r], want[r])
        at_or_above = w[r][x[r] >= float(got[r])].sum()
        above = w[r][x[r] > float(got[r])].sum()
        assert at_or_above >= goal[r] * (1 - TOLERANCE) and above < goal[r] * (1 + TOLERANCE), r
        assert abs(float(w[r][x[r] >= float(want[r])].sum() - goal[r])) < TOLERANCE * float(goal[r]) or \
            abs(float(w[r][x[r] > float(want[r])].sum() - goal[r])) < TOLERANCE * float(goal[r]), r
    return got, int(differs.sum())


def _mixed_batch(n, dtype):
    """Flat and peaked rows, T from 0.33 to 2, top-p on 80% of the rows, top-k on 30%, min-p on 20%."""
    logits = _logits(n, dtype)
    logits[::7, 1000:] = float("-inf")  # rows restricted to their first 1000 tokens
    g = torch.Generator().manual_seed(1)
    inv_t = (0.5 + 2.5 * torch.rand(n, generator=g)).cuda()
    top_p = torch.where(torch.rand(n, generator=g) < 0.8, 0.5 + 0.5 * torch.rand(n, generator=g), 1.0).cuda()
    top_k = torch.where(torch.rand(n, generator=g) < 0.3, torch.randint(1, 2000, (n,), generator=g), 0).float().cuda()
    min_p = torch.where(torch.rand(n, generator=g) < 0.2, 0.1 * torch.rand(n, generator=g), 0.0).cuda()
    return logits, inv_t, top_k, top_p, min_p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cut_offs_equal_the_sorted_reference_at_batch_256(dtype):
    n = 256
    logits, inv_t, top_k, top_p, min_p = _mixed_batch(n, dtype)
    got, mismatches = _check_against_sort(logits, inv_t, top_k, top_p, min_p)
    print(f"{dtype}: {mismatches} of {n} cut-offs differ from the sort's (within rounding of p)")
    assert mismatches <= n // 50  # rounding ties are rare; many would mean a real disagreement
    assert torch.equal(got[top_p == 1.0], filter_thresholds_ref(logits, inv_t, top_k, top_p, min_p)[top_p == 1.0])


@pytest.mark.parametrize("cap", [8, 4096])
def test_cut_offs_do_not_depend_on_the_compaction_capacity(cap, monkeypatch):
    """8 slots: nearly every part scans its whole chunk at every pass; 4096: parts copy [lo, hi) at the first pass
    they can. Both give the sort's cut-offs (within rounding of p) on the compiled kernel."""
    monkeypatch.setattr(sampling_filter, "_CAP", cap)
    logits, inv_t, top_k, top_p, min_p = _mixed_batch(256, torch.bfloat16)
    got, mismatches = _check_against_sort(logits, inv_t, top_k, top_p, min_p)
    assert mismatches <= 256 // 50


def test_top_k_through_the_search_keeps_the_k_best(monkeypatch):
    """Top-k alone through the cut-off search (gpu_draw.SEARCH_TOP_K): the drawn tokens are among each row's k best
    (float32 logits: distinct values, so exactly k are kept)."""
    monkeypatch.setattr(gpu_draw, "SEARCH_TOP_K", True)
    n = 64
    logits = _logits(n, torch.float32, seed=3)
    ks = [1, 5, 50, 1000]
    rows = [SamplingRow(SamplingSpec(temperature=1.0, top_k=ks[i % 4], seed=i), [1], 1) for i in range(n)]
    tokens = sample_tokens(logits, rows)
    rank = (logits > logits.gather(1, tokens.unsqueeze(1))).sum(1)
    assert all(int(rank[i]) < ks[i % 4] for i in range(n))
    assert torch.equal(tokens[::4], logits[::4].argmax(1))  # top-k 1 is greedy


def test_sampled_tokens_stay_in_the_kept_set_and_depend_only_on_row_and_seed():
    n = 256
    logits = _logits(n, seed=2)
    rows = [SamplingRow(SamplingSpec(temperature=0.7, top_p=0.9, top_k=40 if i % 3 == 0 else 0, seed=i), [1, 2], 1)
            for i in range(n)]
    tokens = sample_tokens(logits, rows)
    assert torch.equal(sample_tokens(logits, rows), tokens)
    inv_t = torch.full((n,), 1 / 0.7, device="cuda")
    top_k = torch.tensor([40.0 if i % 3 == 0 else 0.0 for i in range(n)], device="cuda")
    top_p, min_p = torch.full((n,), 0.9, device="cuda"), torch.zeros(n, device="cuda")
    cut = filter_thresholds_ref(logits, inv_t, top_k, top_p, min_p)
    chosen = logits.float().gather(1, tokens.unsqueeze(1)).squeeze(1) * inv_t
    assert torch.all(chosen >= cut)
    for i in (0, 5, 255):
        assert int(sample_tokens(logits[i:i + 1], rows[i:i + 1])[0]) == int(tokens[i])


def test_top_p_draws_follow_the_renormalised_distribution():
    n = 4000
    probs = torch.full((VOCAB,), 0.1 / (VOCAB - 3), dtype=torch.float64)
    probs[:3] = torch.tensor([0.4, 0.3, 0.2], dtype=torch.float64)
    logits = probs.log().float().cuda().expand(n, VOCAB).contiguous()
    rows = [SamplingRow(SamplingSpec(temperature=1.0, top_p=0.8, seed=s), [1], 1) for s in range(n)]
    tokens = sample_tokens(logits, rows).cpu()
    assert int(tokens.max()) <= 2  # mass before the 0.2 is 0.7 < 0.8: kept; the tail is dropped
    counts = torch.bincount(tokens, minlength=3).double()
    expected = torch.tensor([0.4, 0.3, 0.2], dtype=torch.float64) / 0.9 * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, (chi2, counts.tolist())  # 2 degrees of freedom, p = 0.001


def test_logit_bias_forces_and_bans_tokens_at_the_qwen3_vocabulary():
    """logit_bias on CUDA (a scatter into a float32 copy, then the Gumbel kernel): +100 on a token makes every draw
    take it, even under top-p; -100 on a row's peaks makes no draw take them; greedy rows follow the bias too."""
    logits = _logits(64, seed=5)
    logits[63] = 0.0
    logits[63, 10], logits[63, 20] = 5.0, 4.0
    peaks = logits.float().topk(8, dim=1).indices.tolist()
    forced = [SamplingRow(SamplingSpec(temperature=1.0, top_p=0.9, seed=s, logit_bias={777: 100.0}), [1, 2], 1)
              for s in range(32)]
    banned = [SamplingRow(SamplingSpec(temperature=1.0, seed=s, logit_bias={t: -100.0 for t in peaks[32 + s]}),
                          [1, 2], 1) for s in range(31)]
    greedy = [SamplingRow(SamplingSpec(temperature=0.0, logit_bias={10: -100.0}), [1, 2], 1)]
    tokens = sample_tokens(logits, forced + banned + greedy).tolist()
    assert tokens[:32] == [777] * 32
    assert all(t not in peaks[32 + s] for s, t in enumerate(tokens[32:63]))
    assert tokens[63] == 20
