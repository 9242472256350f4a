"""The pure-torch attention backend (CPU production path, CUDA fallback, and the reference the kernels test against).

Each step: store the new K/V at their slots (slot -1 skipped), then attend. Sequences with one query token
(decodes) are attended together in one batched gather over their block tables; sequences with several
(prefills, chunks, the rest after a prefix-cache hit) go one by one through scaled_dot_product_attention
with a causal mask offset by the cached prefix: query i of a sequence with q new tokens and context L sits
at position L - q + i and sees keys 0 .. L - q + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels import cpu_native
from shardserve.kernels.backends import AttentionBackend, AttentionMetadata, cache_zeros
from shardserve.kernels.kv_fp8 import dequantize_fp8, is_fp8, quantize_fp8
from shardserve.kernels.torch_paged_decode import (DecodeIndex, build_decode_index, is_transposed,
                                                    paged_decode, transposed_k_cache)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Writes k/v [T, kv_heads, head_dim] into the flattened caches at slot_mapping [T]; slot -1 is skipped; an
    FP8 cache gets them quantized with its scales. Also the reference the Triton store_kv (store_kv.py) is tested
    against."""
    keep = slot_mapping >= 0
    _store(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep].long(), k_scale, v_scale)


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """store_kv for rows that all have a slot (slots: int64, one per row)."""
    if cpu_native.store_kv(k, v, k_cache, v_cache, slots):
        return  # the CPU's transposed K in C: one pass for both caches
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_fp8(cache):  # index_copy_ has no float8 kernel on CPU: the bytes are copied as uint8
            cache, new = cache.view(torch.uint8), quantize_fp8(new, scale).view(torch.uint8)
        else:
            new = new.to(cache.dtype)
        if cache.is_contiguous():
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, new)
        else:  # K transposed within its blocks (new_cache on the CPU): written through the view
            block_size = cache.shape[1]
            cache.index_put_((slots // block_size, slots % block_size), new)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached positions of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    # index_select: several times faster on CPU than advanced indexing for this gather
    blocks = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, kv_heads, head_dim]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    store_kv = staticmethod(store_kv)

    def __init__(self) -> None:
        # Per step (every layer gets the same metadata object): the in-place decode's index, and the slots the
        # new K/V go to when every row has one (None: some rows have slot -1)
        self._decode_index: tuple[AttentionMetadata, DecodeIndex] | None = None
        self._slots: tuple[AttentionMetadata, torch.Tensor | None] | None = None

    def new_cache(self, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        """A CPU cache in a float dtype (not FP8) keeps K transposed within each block: its decode reads K^T's rows
        (torch_paged_decode.py). FP8 and CUDA caches keep the usual layout."""
        if not (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)):
            return super().new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        v_cache = cache_zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
        return transposed_k_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device), v_cache

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None):
        if self._slots is None or self._slots[0] is not meta:  # the step's first layer
            slots = meta.slot_mapping  # (on CUDA not read back here: a graph may be capturing)
            valid = slots.device.type == "cpu" and bool((slots >= 0).all())
            self._slots = (meta, slots.long() if valid else None)
        if self._slots[1] is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:
            _store(k, v, k_cache, v_cache, self._slots[1], k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        scales = (k_scale, v_scale) if is_fp8(k_cache) else None
        query_lens = meta.query_lens_cpu
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_seqs:
            self._decode(q, out, k_cache, v_cache, meta, scale, decode_seqs, starts, scales)
        for i, n in enumerate(query_lens):
            if n > 1:
                self._prefill_one(q, out, k_cache, v_cache, meta, scale, i, starts[i], n, scales)
        return out

    def _prefill_one(self, q, out, k_cache, v_cache, meta, scale, seq: int, start: int, q_len: int, scales) -> None:
        context = meta.seq_lens_cpu[seq]
        table = meta.block_tables[seq]
        keys = gather_context(k_cache, table, context)  # [L, kv_heads, D]
        values = gather_context(v_cache, table, context)
        if scales is not None:
            keys, values = dequantize_fp8(keys, scales[0], q.dtype), dequantize_fp8(values, scales[1], q.dtype)
        query = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if q_len == context:  # no cached prefix: plain causal
            result = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            query_pos = torch.arange(context - q_len, context, device=q.device)
            key_pos = torch.arange(context, device=q.device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [q_len, L], True = attend
            result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = result.squeeze(0).transpose(0, 1)

    def _decode(self, q, out, k_cache, v_cache, meta, scale, seqs: list[int], starts: list[int], scales) -> None:
        """One query per sequence. On the CPU a cache in the model's dtype is read in place (torch_paged_decode.py:
        float32, or any float dtype with K transposed); otherwise sequences of similar length are gathered and
        attended together (padding at most ~2x)."""
        if (q.device.type == "cpu" and k_cache.dtype == q.dtype
                and (q.dtype == torch.float32 or is_transposed(k_cache))):
            self._decode_in_place(q, out, k_cache, v_cache, meta, scale, seqs, starts)
            return
        by_length = sorted(seqs, key=lambda i: meta.seq_lens_cpu[i], reverse=True)
        group: list[int] = []
        for i in by_length:
            if group and meta.seq_lens_cpu[i] * 2 < meta.seq_lens_cpu[group[0]]:
                self._decode_group(q, out, k_cache, v_cache, meta, scale, group, starts, scales)
                group = []
            group.append(i)
        self._decode_group(q, out, k_cache, v_cache, meta, scale, group, starts, scales)

    def _decode_in_place(self, q, out, k_cache, v_cache, meta, scale, seqs: list[int], starts: list[int]) -> None:
        kernel = cpu_native.decode_kernel(q.dtype, q.shape[2], k_cache.shape[1]) if is_transposed(k_cache) else None
        if kernel is not None:  # the C kernel (cpu_native.py): no index, the tables and lengths as they are
            if len(seqs) == len(q):  # a decode-only batch: its tokens are its sequences, in order
                out.copy_(cpu_native.paged_decode(kernel, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                  scale))
                return
            def decode_rows():  # once a step: the decodes' tokens, block tables and lengths
                rows = torch.tensor(seqs)
                return (torch.tensor([starts[i] for i in seqs]), meta.block_tables.index_select(0, rows),
                        meta.seq_lens.index_select(0, rows))

            token_idx, tables, lens = meta._once("cpu_native_decode_rows", decode_rows)
            result = cpu_native.paged_decode(kernel, q.index_select(0, token_idx), k_cache, v_cache, tables, lens,
                                             scale)
            out.index_copy_(0, token_idx, result.to(q.dtype))
            return
        if self._decode_index is None or self._decode_index[0] is not meta:  # the step's first layer
            rows = meta.block_tables if len(seqs) == meta.num_seqs else meta.block_tables[torch.tensor(seqs)]
            index = build_decode_index(rows, [meta.seq_lens_cpu[i] for i in seqs], k_cache.shape[1], q.shape[1],
                                       k_cache.shape[2], q.shape[2] if is_transposed(k_cache) else None)
            self._decode_index = (meta, index)
        index = self._decode_index[1]
        if len(seqs) == len(q):  # a decode-only batch: its tokens are its sequences, in order
            out.copy_(paged_decode(q, k_cache, v_cache, index, scale))
            return
        token_idx = torch.tensor([starts[i] for i in seqs])
        out.index_copy_(0, token_idx, paged_decode(q.index_select(0, token_idx), k_cache, v_cache, index, scale))

    def _decode_group(self, q, out, k_cache, v_cache, meta, scale, seqs: list[int], starts: list[int],
                      scales) -> None:
        """Gathers the group's blocks (padded to its longest sequence), masks past each seq_len, one SDPA call."""
        device = q.device
        batch = len(seqs)
        token_idx = torch.tensor([starts[i] for i in seqs], device=device)
        lens_cpu = [meta.seq_lens_cpu[i] for i in seqs]
        max_len = max(lens_cpu)
        block_size = k_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables[torch.tensor(seqs, device=device), :num_blocks].reshape(-1).long()
        num_kv_heads, head_dim = k_cache.shape[-2:]
        num_heads = q.shape[1]

        def gather(cache: torch.Tensor, head_scale: torch.Tensor | None) -> torch.Tensor:  # [B, kv_heads, max_len, D]
            blocks = cache.index_select(0, tables).reshape(batch, num_blocks * block_size, num_kv_heads, head_dim)
            blocks = blocks[:, :max_len].transpose(1, 2)
            return blocks.to(q.dtype) if head_scale is None else dequantize_fp8(blocks, head_scale, q.dtype, 1)

        lens = torch.tensor(lens_cpu, device=device)
        visible = torch.arange(max_len, device=device).unsqueeze(0) < lens.unsqueeze(1)  # [B, max_len]
        # the query heads sharing a KV head become that head's "query rows": [B, kv_heads, group, head_dim]
        query = q.index_select(0, token_idx).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        result = F.scaled_dot_product_attention(
            query, gather(k_cache, scales and scales[0]), gather(v_cache, scales and scales[1]), attn_mask=visible[:, None, None, :], scale=scale
        )
        out.index_copy_(0, token_idx, result.reshape(batch, num_heads, head_dim))
