"""Every live request's block table, kept on the step's device and changed only where a plan changes it.

A step's kernels need each scheduled request's block table. Sending the tables whole every step costs the host
time in proportion to the context (a batch of 256 at 1-2k tokens: ~28k entries a step to list, convert and copy),
although a decode step appends at most one block per request. Here each request owns a row of one
[rows, cols] int32 table on the device:
  - a new request takes a free row, and its blocks become writes into that row; a plan's new blocks for a running
    request become writes of just those entries; a finished or preempted request gives its row back;
  - the writes are applied by flush(): one small host-to-device copy and one index_copy_, queued on the step's
    stream before its kernels (a step still running was queued before, so it is done with what it read);
  - a step names its requests' rows, and gather() applies the staged writes, then copies those rows into the
    [n, width] table the kernels read.
Entries past a request's last block (left from an earlier owner of the row) are never read: the kernels stop at
each sequence's context length. The table grows (rows doubled, columns to the widest write) where it must.
"""

from __future__ import annotations

import torch

from shardserve.worker.device_copy import device_tensor

_FIRST_ROWS = 64


class DeviceBlockTables:
    def __init__(self, rows: int = _FIRST_ROWS, cols: int = 0) -> None:
        self._rows, self._cols = max(1, rows), max(1, cols)  # the table's size (the device's follows at flush)
        self.table: torch.Tensor | None = None  # [rows, cols] int32, made on flush()'s device
        self._used = 0  # rows handed out so far (free or not)
        self._free: list[int] = []
        self._write_rows: list[int] = []  # staged writes: table[row, col] = block
        self._write_cols: list[int] = []
        self._write_blocks: list[int] = []

    def assign(self) -> int:
        """A free row for a new request."""
        if self._free:
            return self._free.pop()
        self._used += 1
        return self._used - 1

    def release(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, first_col: int, blocks: list[int]) -> None:
        """Stages table[row, first_col:first_col + len(blocks)] = blocks (applied by the next flush)."""
        self._write_rows += [row] * len(blocks)
        self._write_cols += range(first_col, first_col + len(blocks))
        self._write_blocks += blocks

    def take_writes(self) -> list[int]:
        """The staged writes as one host list, [flat index into the table] * k + [block] * k; the table's size grows
        where they need a larger one (the host half of flush)."""
        if not self._write_blocks:
            return []
        while self._rows < self._used:
            self._rows *= 2
        self._cols = max(self._cols, max(self._write_cols) + 1)
        cols = self._cols
        flat = [row * cols + col for row, col in zip(self._write_rows, self._write_cols)] + self._write_blocks
        self._write_rows, self._write_cols, self._write_blocks = [], [], []
        return flat

    def flush(self, device: torch.device) -> torch.Tensor:
        """Applies the staged writes on device (without waiting for it) and returns the table."""
        writes = self.take_writes()
        if self.table is None:
            self.table = torch.zeros(self._rows, self._cols, dtype=torch.int32, device=device)
        elif self.table.shape != (self._rows, self._cols):
            grown = torch.zeros(self._rows, self._cols, dtype=torch.int32, device=device)
            old_rows, old_cols = self.table.shape
            grown[:old_rows, :old_cols] = self.table
            self.table = grown
        if writes:
            count = len(writes) // 2
            staged = device_tensor(writes, torch.int64, device)
            self.table.view(-1).index_copy_(0, staged[:count], staged[count:].to(torch.int32))
        return self.table

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width] int32: the first width entries of the given rows (int64, on the step's device), the staged
        writes applied first."""
        return self.flush(rows.device)[:, :width].index_select(0, rows)
