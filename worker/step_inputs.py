"""One step's batch as the forward takes it: the scheduled requests' states (RequestState, kept by InputBatch:
worker/input_batch.py), their inputs packed as one int64 host list (pack_inputs), and the device views of that list
after one copy (StepInputs.to_device), with the tokens still on the device gathered in; and a padded decode batch's
inputs as views of the decode graphs' static staging buffer (decode_inputs_from_staging: worker/cuda_graphs.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from shardserve.kernels.backends import AttentionMetadata
from shardserve.kernels.store_kv import decode_slots
from shardserve.proto.plan import SamplingSpec
from shardserve.worker.block_tables import DeviceBlockTables
from shardserve.worker.device_copy import device_tensor


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # prompt + generated, including the tokens sampled here (PENDING until read back)
    num_prompt_tokens: int
    num_computed: int  # positions whose KV is in the cache
    block_ids: list[int]
    sampling: SamplingSpec
    table_row: int  # its row of the device block table (worker/block_tables.py)
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)  # PENDING position -> (step id, row) of its id


def pack_inputs(
    input_ids: list[int],
    positions: list[int],
    table_rows: list[int],
    padded: int | None = None,
    seq_lens: list[int] | None = None,
    query_lens: list[int] | None = None,
) -> list[int]:
    """A step's inputs as one int64 host list:

        input ids [L] | positions [L] | context lengths [S] | table rows [n] | query_start_loc [n + 1]

    (table rows: each sequence's row of the device block table.) Eager (padded None): L is the token count rounded up
    to even, so that the two sections read in place as int64 start 16-byte aligned (Triton specialises kernels on
    pointer alignment: positions at an odd offset would compile a second RoPE variant mid-run); S = n. For a
    decode graph of size padded (one token per sequence): L = S = padded, padding rows get id 0, position 0 and
    context length 0, and there is no query_start_loc (the graph keeps a static one). seq_lens and query_lens
    default to one token per sequence (position + 1, 1).
    """
    num_tokens = len(input_ids)
    pad = [0] * ((padded if padded is not None else num_tokens + num_tokens % 2) - num_tokens)
    flat = input_ids + pad + positions + pad + (seq_lens if seq_lens is not None else [p + 1 for p in positions])
    if padded is not None:
        flat += pad
    flat += table_rows
    if padded is None:
        flat.append(0)
        flat += itertools.accumulate(query_lens) if query_lens is not None else range(1, num_tokens + 1)
    return flat


def slot_mapping(
    block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[T] int64 cache slot of each token: its block (from its row's table, by position) * block_size + the offset."""
    return block_tables[rows, positions // block_size].long() * block_size + positions % block_size


@dataclass(slots=True, eq=False)
class StepInputs:
    """One step's batch: the scheduled requests and their inputs as pack_inputs lays them out (host side)."""

    states: list[RequestState]  # the scheduled requests, in plan order
    sample_rows: list[int]  # which of them sample (this step reaches the end of their token list) ...
    sampling_states: list[RequestState]  # ... and their states
    flat: list[int]
    num_tokens: int
    width: int  # of the block tables: the most blocks a scheduled request reads
    tables: DeviceBlockTables  # the rows of every request, with this step's writes staged
    padded: int | None  # the decode graph size the batch is padded to; None: eager
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    gathers: list[tuple[torch.Tensor, list[int], list[int]]]  # (a step's sampled ids, input rows, their rows)

    @property
    def num_seqs(self) -> int:
        return len(self.states)

    def gather_pending(self, input_ids: torch.Tensor) -> None:
        """Writes the tokens still on the device into input_ids (this batch's ids, copied to the device already),
        from the sampled ids that hold them: one index copy per step in flight, no host sync."""
        for tokens, dst, src in self.gathers:
            index = device_tensor(dst + src, torch.int64, input_ids.device)
            input_ids.index_copy_(0, index[: len(dst)], tokens.index_select(0, index[len(dst) :]))

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The eager forward's inputs: one copy of the flat list to the device, then views of it (input ids with
        the pending tokens gathered, positions), the batch's rows of the block table and the attention metadata."""
        num_tokens, num_seqs, bs = self.num_tokens, self.num_seqs, self.block_size
        dev = device_tensor(self.flat, torch.int64, device)
        span = num_tokens + num_tokens % 2
        input_ids = dev[:num_tokens]
        positions = dev[span : span + num_tokens]
        offset = 2 * span
        seq_lens = dev[offset : offset + num_seqs].to(torch.int32)
        offset += num_seqs
        block_tables = self.tables.gather(dev[offset : offset + num_seqs], self.width)
        query_start_loc = dev[offset + num_seqs :].to(torch.int32)
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_start_loc.diff(), output_size=num_tokens
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping(block_tables, seq_of_token, positions, bs),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
        )
        self.gather_pending(input_ids)
        return input_ids, positions, meta


def decode_inputs_from_staging(
    staging: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor, padded: int, block_size: int,
    max_seq_len: int, rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and attention metadata of a padded decode batch, as views and device ops only
    (what a graph captures). max_seq_len only sizes host-side choices; the kernels read seq_lens. rows: [padded]
    int64 0, 1, ... on the device, the sequence of each token (the runner passes its static one)."""
    input_ids = staging[:padded]
    positions = staging[padded : 2 * padded]
    tables = block_tables[:padded]
    if staging.is_cuda:  # one launch
        slots, seq_lens = decode_slots(positions, staging[2 * padded : 3 * padded], tables, block_size)
    else:
        seq_lens = staging[2 * padded : 3 * padded].to(torch.int32)
        if rows is None:
            rows = torch.arange(padded, device=staging.device)
        slots = torch.where(seq_lens > 0, slot_mapping(tables, rows, positions, block_size), -1)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start_loc[: padded + 1],
        seq_lens=seq_lens,
        block_tables=tables,
        query_lens_cpu=[1] * padded,
        seq_lens_cpu=[max_seq_len] * padded,
        max_query_len=1,
        max_seq_len=max_seq_len,
    )
    return input_ids, positions, meta
