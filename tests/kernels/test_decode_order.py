"""The decode programs' order (kernels/decode_order.py): the Triton ranking gives what a stable descending argsort
gives, ties in batch order, across its tiles of sequences and contexts."""

import pytest
import torch

from shardserve.kernels.decode_order import longest_first, rank_order


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 129, 300])
def test_the_ranking_kernel_is_a_stable_descending_argsort(n):
    gen = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, 40, (n,), generator=gen, dtype=torch.int32)  # many ties, zeros (padding rows) too
    expected = torch.argsort(lengths, descending=True, stable=True).to(torch.int32)
    assert torch.equal(rank_order(lengths), expected)
    assert torch.equal(longest_first(lengths), expected)


def test_an_empty_batch_has_an_empty_order():
    assert rank_order(torch.zeros(0, dtype=torch.int32)).shape == (0,)
