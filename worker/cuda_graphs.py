"""CUDA graphs for decode steps: the model forward captured once per padded batch size, then replayed.

Why: a decode step is thousands of short kernels whose launch cost (Python + driver) rivals their run time on
an H200; a graph replay launches them all in one call.

What is captured: the model forward (embedding -> layers -> final norm, all-reduces included for TP: NCCL
calls are capturable) for a decode-only batch padded to one of graph_batch_sizes(). The LM head, the logits and
sampling stay eager: they run on the real rows only and the sampler branches on host data. (The LM head and a
greedy argmax inside the graphs left bs=1 latency unchanged and were removed.)

Inputs of a graph of size B with n real rows: worker/input_batch.py prepares a decode batch the graphs cover
already padded to B (pack_inputs), and run() copies that host list into static device buffers:
  staging (int64): token ids [B] | positions [B] | context lengths [B] | the n sequences' rows of the device block
    table [n] (one host-to-device copy; padding rows get id 0, position 0, context length 0),
  then the block table's staged writes (worker/block_tables.py), the n rows' first w entries gathered from it
  into the static [max B, max_blocks] int32 block table, and the tokens still on the device (async scheduling)
  gathered into the ids.
Inside the graph each row's cache slot is its table entry at pos // block_size (one launch on CUDA,
kernels/store_kv.decode_slots; step_inputs.slot_mapping elsewhere), or -1 where the context length is 0: store_kv
skips padding rows and the decode kernel reads no keys for them (their output is zeros that nobody reads). Entries
of a table row past its context are stale and never read.

Attention: only the Triton backend is graph-safe here. Its decode kernel computes the split ranges on the device
from seq_lens, so a split count fixed per captured size (chosen for max_model_len) is correct for any length.

Memory: all graphs share one pool, captured largest first so the smaller ones reuse its blocks; what they will
take is reserved before the KV cache is sized (worker/graph_memory.py). After the real capture the memory taken is
measured again and printed next to the reserve.
"""

from __future__ import annotations

import bisect
import gc
import sys
import time
from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import cdiv
from shardserve.worker.device_copy import copy_to_buffer
from shardserve.worker.step_inputs import StepInputs, decode_inputs_from_staging

MAX_GRAPH_BATCH_SIZE = 512  # a larger max_num_seqs still runs: bigger decode batches go eager


def graph_batch_sizes(max_num_seqs: int, cap: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """1, 2, 4, then every multiple of 8 below the limit, then the limit (max_num_seqs, at most cap)."""
    limit = max(1, min(max_num_seqs, cap))
    return [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8)) + [limit]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does."""
    if num_seqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphRunner:
    """Captured decode forwards over one KV cache. use_cuda_graphs=False runs the very same padded static-buffer
    path eagerly (how CPU tests check the padding and slot logic without a GPU)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        batch_sizes: list[int],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        use_cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.batch_sizes = sorted(batch_sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs
        largest = self.batch_sizes[-1]
        self._staging = torch.zeros(4 * largest, dtype=torch.int64, device=device)
        self._block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(largest, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._last: tuple[torch.Tensor, ...] = ()  # the last replay's outputs
        self._pool = None
        self._stream = None
        self.memory_bytes = 0  # device memory the captured graphs took (free memory before - after)
        self.capture_s = 0.0

    # ---- capture -------------------------------------------------------------------------------------------
    def num_splits(self, padded: int) -> int:
        """The decode split count baked into the graph of this size (chosen for the longest context)."""
        from shardserve.kernels.paged_decode import choose_num_splits

        num_kv_heads = self.kv_caches[0][0].shape[2] if self.kv_caches else 1
        return choose_num_splits(padded, num_kv_heads, self.max_model_len)

    @contextmanager
    def _fixed_splits(self, padded: int) -> Iterator[None]:
        if not hasattr(self.backend, "decode_num_splits"):
            yield
            return
        previous = self.backend.decode_num_splits
        self.backend.decode_num_splits = self.num_splits(padded)
        try:
            yield
        finally:
            self.backend.decode_num_splits = previous

    def _forward(self, padded: int) -> tuple[torch.Tensor, ...]:
        """(hidden states,) of every padded row."""
        ids, positions, meta = decode_inputs_from_staging(
            self._staging, self._block_tables, self._query_start_loc, padded, self.block_size, self.max_model_len,
            self._rows[:padded],
        )
        return (self.model(ids, positions, self.kv_caches, meta),)

    def capture(self, sizes: list[int] | None = None) -> None:
        """Captures the given sizes (default: all), largest first, into the shared pool. No-op without graphs.
        Capturing a size again replaces its graph; probe() keeps extra copies (for measuring only)."""
        if not self.use_cuda_graphs:
            return
        gc.collect()  # once: the captures below skip torch.cuda.graph's own collect
        for padded in sorted(sizes or self.batch_sizes, reverse=True):
            self._graphs[padded], self._outputs[padded] = self._capture_measured(padded)

    def probe(self, padded: int, copies: int) -> list[tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]]:
        """Captures `copies` more graphs of one size and returns them (the caller keeps them alive while it reads
        the memory they take; dropping them frees it)."""
        gc.collect()
        return [self._capture_measured(padded) for _ in range(copies)]

    def _capture_measured(self, padded: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        # torch.cuda.graph would garbage-collect and empty the cache before every capture (seconds over 35
        # sizes); the caller collected once before the first.
        with mock.patch("gc.collect", lambda *args, **kwargs: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            with self._fixed_splits(padded), torch.cuda.stream(self._stream):
                # Warm-up on the capture stream: compiles the Triton kernels of this size and creates cuBLAS and
                # NCCL state before capture, where neither may happen.
                self._forward(padded)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with self._fixed_splits(padded):
                # thread_local: NCCL's watchdog thread queries events during capture; only this thread is checked.
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                    output = self._forward(padded)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - started
        self.memory_bytes += free_before - torch.cuda.mem_get_info(self.device)[0]
        return graph, output

    # ---- replay --------------------------------------------------------------------------------------------
    def padded_size(self, num_seqs: int, max_seq_len: int) -> int | None:
        """The captured size a decode batch pads to, or None where no graph covers it (it runs eagerly)."""
        padded = padded_batch_size(num_seqs, self.batch_sizes)
        if padded is None or (self.use_cuda_graphs and padded not in self._graphs):
            return None
        return padded if cdiv(max_seq_len, self.block_size) <= self.max_blocks else None

    def run(self, batch: StepInputs) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch prepared for this runner (batch.padded: a size that
        padded_size chose; row i = sequence i): its inputs into the static buffers, then the replay.
        The result is a view of the graph's output: use it before the next run."""
        n, padded, width = batch.num_seqs, batch.padded, batch.width
        staged = copy_to_buffer(self._staging, batch.flat)
        self._block_tables[:n, :width] = batch.tables.gather(staged[3 * padded : 3 * padded + n], width)
        batch.gather_pending(staged[:n])
        return self.replay(padded)[:n]

    def replay(self, padded: int) -> torch.Tensor:
        """The forward of the graph of one captured size over what the static buffers hold (all padded rows)."""
        if self.use_cuda_graphs:
            self._graphs[padded].replay()
            self._last = self._outputs[padded]
        else:
            with self._fixed_splits(padded):
                self._last = self._forward(padded)
        return self._last[0]

    def rows(self, n: int) -> torch.Tensor:
        """[0, n) on the device: the row of each sequence's token in run()'s output."""
        return self._rows[:n]


# ---- wiring for ModelRunner ----------------------------------------------------------------------------------
def graphs_unsupported_reason(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> str | None:
    if device.type != "cuda":
        return "not on CUDA"
    if config.enforce_eager:
        return "enforce_eager is set"
    if getattr(backend, "name", "") != "triton":
        return f"the {getattr(backend, 'name', '?')} attention backend is not graph-safe here (only triton is)"
    return None


def capture_decode_graphs(
    model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
    config: EngineConfig, device: torch.device, reserved_bytes: int | None = None,
) -> DecodeGraphRunner | None:
    """Captures every size over the allocated cache; on any failure prints a warning and returns None (eager)."""
    sizes = graph_batch_sizes(config.max_num_seqs)
    runner = None
    try:
        runner = DecodeGraphRunner(model, kv_caches, backend, sizes, config.block_size, config.max_model_len, device)
        with torch.inference_mode():
            runner.capture()
    except Exception as exc:  # a capture failure must cost speed, never the engine
        say(f"WARNING: CUDA graph capture failed ({type(exc).__name__}: {exc}); decode steps run eagerly")
        runner = None
        release_memory()
        return None
    reserve = f", reserved {reserved_bytes / 2**20:.0f} MiB" if reserved_bytes is not None else ""
    say(f"captured {len(sizes)} decode CUDA graphs (batch sizes {sizes[0]}..{sizes[-1]}) in {runner.capture_s:.1f} s, "
         f"{runner.memory_bytes / 2**20:.0f} MiB{reserve}")
    if reserved_bytes is not None and runner.memory_bytes > reserved_bytes:
        say(f"WARNING: the graphs took {runner.memory_bytes / 2**20:.0f} MiB, more than the "
             f"{reserved_bytes / 2**20:.0f} MiB the KV sizing reserved for them")
    return runner


def release_memory() -> None:
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # a failed capture can leave an error behind; the next CUDA call will report it
        pass


def say(message: str) -> None:
    print(f"[shardserve] {message}", file=sys.stderr, flush=True)
