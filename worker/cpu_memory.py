"""The CPU path's temporaries: kept mapped between steps instead of handed back to the kernel and faulted in again.

torch's CPU tensors come from malloc, with no cache of its own. glibc serves a block above its mmap threshold (128
KiB at first, rising with what is freed, at most 32 MiB) with a fresh mmap and unmaps it on free, and it returns the
free top of a heap to the kernel once it exceeds the trim threshold. A step's temporaries are that size (a 2,048-token
prefill chunk's MLP activations are 6-25 MB in float32) and live for one op, so every step faulted its pages in anew:
the kernel zeroing pages (`clear_page_erms`) was ~5% of the CPU benchmark's samples in float32 and ~0.9 s of its
7.4 s of prefill (docs/performance.md).

keep_freed_memory() pins the mmap threshold at glibc's largest (32 MiB: blocks up to that come from the heaps) and
lifts the trim threshold (a heap's free top stays mapped), so the pages a step used are reused by the next. The
cost is a resident size that stays at the largest step's peak rather than shrinking between steps. It acts only
under glibc and only once a process; SHARDSERVE_CPU_KEEP_FREED=0 leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit hosts (HEAP_MAX_SIZE / 2); above it mallopt refuses
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: up to 2 GiB of a heap's free top stays mapped

_done = False


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds as above, once a process. True when they are set (now or before)."""
    global _done
    if _done:
        return True
    if os.environ.get("SHARDSERVE_CPU_KEEP_FREED", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.warning("mallopt refused the thresholds; the CPU path's temporaries are faulted in each step")
        return False
    _done = True
    return True
