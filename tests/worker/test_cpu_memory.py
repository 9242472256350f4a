"""keep_freed_memory(): step-sized temporaries come from malloc's heaps, whose freed pages stay mapped for the next
step, instead of a fresh mmap each (worker/cpu_memory.py). Each case runs in a fresh interpreter, since the setting
is process-wide and stays once set; glibc's mallinfo2() says where a block came from."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

_WHERE_BLOCKS_COME_FROM = """
import ctypes, torch
from shardserve.worker.cpu_memory import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
print(keep_freed_memory(), keep_freed_memory())  # the second call: already set
mapped = mallinfo2().hblkhd
block = torch.ones(6 * 1024 * 1024)  # 24 MiB, a 2,048-token chunk's MLP activations in float32
print(mallinfo2().hblkhd - mapped)  # bytes in blocks mmapped on their own
del block
steps = [torch.ones(6 * 1024 * 1024) for _ in range(8)]  # a step's temporaries, 192 MiB
heap = mallinfo2().arena
del steps
print(heap, mallinfo2().arena)  # the heaps' size while they lived, and after they were freed
"""


def _run(switch: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("SHARDSERVE_CPU_KEEP_FREED", None)
    if switch is not None:
        env["SHARDSERVE_CPU_KEEP_FREED"] = switch
    return subprocess.run([sys.executable, "-c", _WHERE_BLOCKS_COME_FROM], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()


def test_step_sized_blocks_come_from_the_heap_and_their_pages_stay_mapped_once_freed():
    set_now, set_before, own_mmaps, heap_live, heap_after = _run(None)
    assert (set_now, set_before) == ("True", "True")
    assert int(own_mmaps) == 0  # served by the heap: no mmap of its own, unmapped (and faulted in again) on free
    assert int(heap_live) >= 8 * 24 * 2**20
    assert int(heap_after) == int(heap_live)  # nothing trimmed: the next step reuses the pages


def test_the_switch_leaves_glibcs_thresholds_as_they_are():
    set_now, set_before, own_mmaps, _, _ = _run("0")
    assert (set_now, set_before) == ("False", "False")
    assert int(own_mmaps) >= 24 * 2**20  # glibc's first threshold (128 KiB): the block was mmapped on its own
