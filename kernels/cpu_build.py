"""Building the CPU's C kernels (kernels/cpu_native.py loads them): `cc -O3 -march=native -fopenmp` makes code for
the host's own vector units, linked against the OpenMP runtime torch has loaded (`openmp_runtime`), so the shared
object is cached per source, compiler, flags, runtime and CPU (`$XDG_CACHE_HOME/shardserve/native`, by default
`~/.cache/shardserve/native`), written under a temporary name and renamed into place (processes building it at once
each finish with a whole file); loading an object marks it used (its mtime: `touch`), and a build removes the
objects no process has loaded for UNUSED_DAYS (other sources, compilers, CPUs)."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.c", "cpu_amx.c")]
HEADERS = [Path(__file__).with_name("cpu_vec.h")]
FLAGS = ["-O3", "-march=native", "-fPIC"]
UNUSED_DAYS = 30  # a cached object no process has loaded for this long goes when another one is built


def cached_object(compiler: str) -> Path:
    """The shared object for this host and compiler, built (and the unused ones pruned) where it is not cached yet.
    Raises OSError or subprocess.SubprocessError where the build fails."""
    runtime = openmp_runtime()
    sources = [path.read_text() for path in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*sources, compiler, *FLAGS, str(runtime), _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_decode-{key}.so"
    if not target.exists():
        _build(compiler, runtime, target)
        _prune(target.parent, keep=target)
    return target


def _cache_dir() -> Path:
    """$XDG_CACHE_HOME/shardserve/native, else ~/.cache/shardserve/native (beside the converted default model)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "shardserve" / "native"


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (the cached object is only for CPUs like this)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def openmp_runtime() -> str | None:
    """The OpenMP runtime this process has loaded (torch's: libgomp, or Intel's libiomp5 in some builds), or None.
    The kernel is linked against that very file, so its parallel loops run on torch's thread pool: a second runtime
    would keep its own threads spinning beside torch's on the same cores."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__)  # torch's own copy first, where another is mapped too
    found = sorted((not p.startswith(torch_dir), p) for p in paths
                   if os.path.basename(p).startswith(("libgomp", "libiomp5")))
    return found[0][1] if found else None


def _build(compiler: str, runtime: str | None, target: Path) -> None:
    """Compiles with OpenMP's pragmas on and links against `runtime` alone (no -fopenmp at the link, which would
    add the compiler's own libgomp); without a runtime the loops run serially."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    objects = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
    try:
        omp = ["-fopenmp"] if runtime else []
        for source, obj in zip(SOURCES, objects):
            subprocess.run([compiler, *FLAGS, *omp, "-c", str(source), "-o", obj], check=True, capture_output=True,
                           text=True, timeout=120)
        subprocess.run([compiler, "-shared", *objects, *([runtime] if runtime else []), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        for path in (tmp, *objects):
            if os.path.exists(path):
                os.unlink(path)


def touch(path: Path) -> None:
    """Marks the object as used now (its mtime), so that _prune keeps it; a cache dir one cannot write is fine."""
    try:
        os.utime(path)
    except OSError:
        pass


def _prune(directory: Path, keep: Path) -> None:
    """Removes the objects of other sources, compilers or CPUs that no process has loaded for UNUSED_DAYS (another
    venv or torch may still use one now and then), and what a build that died left there a day ago. A process that
    has a removed object loaded keeps its mapping."""
    now = time.time()
    for path in directory.glob("cpu_decode-*"):
        try:
            age_s = now - path.stat().st_mtime
            if path != keep and age_s > (UNUSED_DAYS * 86400 if path.suffix == ".so" else 86400):
                path.unlink()
        except OSError:  # gone meanwhile (another process pruning), or not ours to remove
            pass
