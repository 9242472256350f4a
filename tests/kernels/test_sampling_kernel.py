"""The Triton Gumbel-max sampler: the same tokens as its torch reference, frequencies that follow softmax(l / T),
masked (-inf) tokens never drawn, and a token that depends only on the row's logits and key. The statistical tests
draw many rows with the torch reference (the interpreter is slow) and check the kernel on a slice of them."""

import pytest
import torch

from shardserve.kernels.sampling import gumbel_sample, gumbel_sample_ref, split_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _keys(values):
    return torch.tensor(split_keys(values), dtype=torch.int64, device=DEVICE).view(-1, 2)


def test_kernel_equals_reference_across_blocks():
    torch.manual_seed(0)
    logits = torch.randn(6, 5000, device=DEVICE) * 3  # 5000: three 2048-wide blocks, the last one masked
    keys = _keys([0, 1, 2**63 + 5, 12345678901234, 2**64 - 1, 42])
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.7, 10.0], device=DEVICE)
    assert torch.equal(gumbel_sample(logits, keys, inv_t), gumbel_sample_ref(logits, keys, inv_t))


def test_the_hash_alone_picks_the_references_token_over_a_full_vocabulary():
    """Flat logits: the draw is the argmax of the hash's noise alone, over Qwen3's 151,936 entries (indices past
    2^16, where the finaliser's shifts mix the index's high bits), with keys whose halves have the top bit set."""
    logits = torch.zeros(2, 151936, device=DEVICE)
    keys = _keys([2**64 - 1, 2**63 + 2**31 + 17])
    inv_t = torch.ones(2, device=DEVICE)
    assert torch.equal(gumbel_sample(logits, keys, inv_t), gumbel_sample_ref(logits, keys, inv_t))


def test_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = torch.log(probs).to(DEVICE).expand(1200, 5).contiguous()  # log(0) = -inf: never drawn
    keys = _keys([(2654435761 * i + 977) % 2**64 for i in range(1200)])
    tokens = gumbel_sample_ref(logits, keys, torch.ones(1200, device=DEVICE))
    assert torch.equal(gumbel_sample(logits[:64], keys[:64], torch.ones(64, device=DEVICE)), tokens[:64])
    counts = torch.bincount(tokens.cpu(), minlength=5).float()
    assert counts[4] == 0
    expected = probs * 1200
    # 4 sigma of a binomial count per token
    assert torch.all((counts[:4] - expected[:4]).abs() < 4 * (expected[:4] * (1 - probs[:4])).sqrt()), counts


def test_temperature_sharpens_and_masks_hold():
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]], device=DEVICE).expand(600, 4).contiguous()
    keys = _keys(list(range(600)))
    cold = torch.bincount(gumbel_sample_ref(logits, keys, torch.full((600,), 10.0, device=DEVICE)).cpu(), minlength=4)
    warm = torch.bincount(gumbel_sample_ref(logits, keys, torch.full((600,), 1.0, device=DEVICE)).cpu(), minlength=4)
    assert cold[3] == 0 and warm[3] == 0
    assert cold[0] > 595 and 330 < warm[0] < 470  # p(0) = 1.0 at T=0.1, 0.665 at T=1 (399 +- 4 sigma)


def test_a_row_depends_only_on_its_logits_and_key():
    torch.manual_seed(1)
    logits = torch.randn(8, 300, device=DEVICE)
    keys = _keys([7 * i + 3 for i in range(8)])
    inv_t = torch.ones(8, device=DEVICE)
    full = gumbel_sample(logits, keys, inv_t)
    alone = torch.stack([gumbel_sample(logits[i : i + 1], keys[i : i + 1], inv_t[i : i + 1])[0] for i in range(8)])
    assert torch.equal(full, alone)
    shuffled = torch.tensor([3, 0, 7, 1, 5, 2, 6, 4], device=DEVICE)
    assert torch.equal(gumbel_sample(logits[shuffled], keys[shuffled], inv_t)[torch.argsort(shuffled)], full)


def test_the_largest_hash_gives_finite_noise():
    """The hash's top value (m = 2^24 - 1) is the largest noise, but finite: computed as 1 - u in float32 it was
    u = 1.0 and infinite noise, so that token won whatever its probability (at Qwen3's vocabulary, ~0.9% of rows).
    With these keys, entry 3983 hashes to it (found by a search over random keys)."""
    from shardserve.kernels.sampling import _fmix32_ref

    key_low, key_high, hit = 2615940615, 1053230405, 3983
    h = _fmix32_ref(_fmix32_ref(torch.tensor([hit]) ^ key_low) ^ key_high)
    assert int(h >> 8) == 2**24 - 1
    logits = torch.full((1, 4096), -30.0, device=DEVICE)
    logits[0, 0] = 0.0  # every other token has probability ~e^-30
    keys = _keys([key_low | key_high << 32])
    inv_t = torch.ones(1, device=DEVICE)
    assert gumbel_sample_ref(logits, keys, inv_t).tolist() == [0]
    assert gumbel_sample(logits, keys, inv_t).tolist() == [0]
