"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous block of ceil(vocab / tp) rows (the last block zero-padded). The embedding
looks up the ids it owns, zeroes the rest and all-reduces; the LM head computes its block of logits and
all-gathers them so every rank sees the full vocabulary. With tied embeddings the head shares the
embedding's Parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.proto.plan import cdiv
from shardserve.worker.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from shardserve.worker.layers import cpu_packed
from shardserve.worker.layers._sharding import attach_loader, copy_into, loaded_shape, narrow_loaded


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = cdiv(vocab_size, self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)  # exclusive; real rows only
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        attach_loader(self.weight, self.weight_loader, {None: (vocab_size, hidden_size)})

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if loaded_shape(loaded)[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded_shape(loaded)[0]} rows, config vocab_size is {self.vocab_size}")
        real_rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param.data.zero_()  # padding rows of the last rank stay 0
        copy_into(param.data[:real_rows], narrow_loaded(loaded, 0, self.vocab_start, real_rows), "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size)
        if tied_to is not None:
            self.weight = tied_to.weight  # one Parameter, loaded once (from embed_tokens)
        self.tied = tied_to is not None
        self.packed_weight: torch.Tensor | None = None  # on CPU: oneDNN's packed copy (layers/cpu_packed.py)
        self.weight_amx = None  # and on CPUs with AMX, the packed bf16 weight as the AMX loop reads it

    def pack_weights(self) -> bool:
        """A packed copy beside the plain weight, which the (tied) embedding reads."""
        self.packed_weight = cpu_packed.pack(self.weight)
        if self.packed_weight is not None:
            self.weight_amx = cpu_packed.amx_weight(self.packed_weight, self.weight)
        return self.packed_weight is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] in the model dtype (as transformers computes them), the full vocabulary
        on every rank. The sampler reads them as they are; float32 copies are made only where a step needs one."""
        if self.packed_weight is not None:
            local_logits = cpu_packed.linear(hidden, self.packed_weight, amx=self.weight_amx)
        else:
            local_logits = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(local_logits)
        return logits[..., : self.vocab_size]
