"""The order the decode kernel starts its sequences' programs in: longest context first (ties in batch order).

The GPU starts a grid's programs about in order, so in a batch of unequal contexts the programs of long contexts
that sit late in the batch would run on alone at the end (kernels/paged_decode.py: ORDERED). On CUDA the order is
one small Triton launch a step instead of torch.argsort, whose radix sort (and the int32 conversion after it) took
a noticeable share of a large batch's decode step: each sequence's rank is the number of contexts
longer than its own plus the equal ones before it, counted against the whole batch in tiles, and the sequence is
written at its rank. The ranks are a permutation, so every program writes one entry and no two write the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_I = 64  # sequences a program ranks
_BLOCK_J = 128  # contexts it compares them with at a time


@triton.jit
def _rank_kernel(seq_lens_ptr, order_ptr, n, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Grid (cdiv(n, BLOCK_I),). order[rank(i)] = i, rank(i) = #{j: len j > len i} + #{j < i: len j == len i}."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < n
    length = tl.load(seq_lens_ptr + i, mask=i_ok, other=0)
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        other = tl.load(seq_lens_ptr + j, mask=j < n, other=-1)  # past n: shorter than any context (>= 0)
        before = (other[None, :] > length[:, None]) | ((other[None, :] == length[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i, mask=i_ok)


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """[num_seqs] int32: the sequences' indices by context length (>= 0), longest first, ties in batch order."""
    if not seq_lens.is_cuda:  # (the kernel's tests run it interpreted on CPU tensors: rank_order)
        return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    return rank_order(seq_lens)


def rank_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """longest_first through the Triton kernel, on any device Triton runs on."""
    n = seq_lens.shape[0]
    order = torch.empty(n, dtype=torch.int32, device=seq_lens.device)
    if n:
        _rank_kernel[(triton.cdiv(n, _BLOCK_I),)](seq_lens, order, n, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J)
    return order
