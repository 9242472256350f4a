"""`--profile PATH`: the torch profiler around a benchmark's timed run, its operator table written to PATH.

The table says where a step's time goes: self CPU time per operator (the host side: Python-driven launches,
input preparation, sampling) and, on CUDA, self device time per kernel. It covers this process only: with
TP > 1 the ranks run in other processes, so profile TP=1 (or the worker processes) to see the model's kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def profiled(path: str | None, device: str, rows: int = 40) -> Iterator[None]:
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device == "cuda":
        tables.insert(0, averages.table(sort_by="self_device_time_total", row_limit=rows))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n\n".join(tables) + "\n")
    print(f"profile: {path} (operator table, this process only)", flush=True)
