"""Process-level settings outside Python: glibc's allocator and ggml's own knobs.

They are read by glibc or ggml from the environment, or set through libc, so each is
applied once, early, in the process it is meant for (daemon, runner, worker).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Any


def apply_native_defaults(deterministic: bool = False) -> None:
    """Environment knobs read by ggml itself, set before the first model loads.

    ggml's tiled matmul takes over from 8 rows per batch, and its flash attention
    splits one token's KV across threads and tiles 64 queries at a time, so a
    sequence's logits depend on how many other tokens share its batch. Deterministic
    mode turns the tiled matmul off and asks for ggml's reference kernels
    (GGML_CPU_USE_REF, which install.sh's build of llama.cpp reads; the engine also
    skips the repacked weight layouts, for the same reason): greedy output is then
    the same alone or batched, drafted or not, on AVX2 as on AVX-512, at a cost in
    throughput (benchmarks/RESULTS.md).
    """
    if deterministic:
        os.environ["GGML_CPU_TILED_MM"] = "0"
        os.environ["GGML_CPU_USE_REF"] = "1"


def quiet_native_aborts() -> None:
    """No gdb backtrace when ggml aborts (a runner whose RPC worker died does).

    ggml attaches gdb to itself to print one when gdb is installed, which holds the
    dying runner for seconds and floods the daemon's log."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Fewer glibc malloc arenas in a process with many threads (the daemon, a runner).

    glibc gives threads their own arenas, up to eight per core, and each keeps
    the pages freed into it: a server's resident size creeps up with every new
    thread that allocates. Call before starting threads; a no-op off glibc.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(-8, arenas)  # M_ARENA_MAX


def pin_mmap_threshold(threshold: int = 128 << 10) -> None:
    """Keep glibc's mmap threshold fixed (it is dynamic by default).

    Each time a block that glibc served with mmap is freed, it raises the threshold to
    that block's size, so later blocks that large (request bodies, JSON replies) come
    from the heap instead, and the heap fragments around the ones still alive. A fixed
    threshold sends every large block to its own mapping, which free() unmaps.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, threshold)  # M_TRIM_THRESHOLD


def trim_malloc() -> None:
    """Hand freed heap pages back to the OS; glibc keeps them otherwise, so a process's
    resident size would stay at its peak, and creep up as free pages fragment."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def resident(runs: list[tuple[int, int]]) -> int:
    """Bytes of the page ranges' pages in memory now (mincore, Linux); a range no longer
    mapped, or any range elsewhere, counts nothing."""
    mincore = _mincore()
    if mincore is None:
        return 0
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for start, end in runs:
        vec = (ctypes.c_ubyte * ((end - start) // page))()
        if mincore(start, end - start, vec) == 0:
            total += bytes(vec).translate(_LOW_BIT).count(1) * page
    return total


_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's flag for "resident"


def small_pages(runs: list[tuple[int, int]]) -> None:
    """Keep the page ranges in base pages (madvise MADV_NOHUGEPAGE, Linux): where
    transparent huge pages are on for all memory (`enabled` = always, the default of
    several distributions), one cell written into a KV buffer would commit the 2 MB
    around it, and the buffer of a context sized for every slot would fill long before
    its cells do. Base pages keep what a KV holds to the cells written."""
    libc, advice = _libc(), getattr(mmap, "MADV_NOHUGEPAGE", None)  # Linux's alone
    if libc is None or advice is None:
        return
    for start, end in runs:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@functools.cache
def _mincore() -> Any:
    """libc's mincore, typed once; None where there is none."""
    try:
        fn = ctypes.CDLL(None).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once: each CDLL builds classes in reference cycles, garbage that
    a housekeeping loop calling this every few seconds would leave behind."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    # Off glibc (musl, macOS) these are absent and every knob here is a no-op.
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def package_parent() -> str:
    """The folder that holds the `corral` package: a child started with `python -m
    corral.X` runs there, so whatever folder the daemon was started in (one holding some
    other `corral`, say) cannot shadow ours."""
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])


def physical_cores() -> int:
    """Physical cores, not logical CPUs: SMT siblings only slow ggml's spinning threads."""
    try:
        cores: set[tuple[str, str]] = set()
        package = core = ""
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    package = value.strip()
                elif key == "core id":
                    core = value.strip()
                elif not line.strip() and core:
                    cores.add((package, core))
                    core = ""
        if core:
            cores.add((package, core))
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        count = len(cores) or (os.cpu_count() or 1)
        return max(1, min(count, allowed) if allowed else count)
    except OSError:
        return max(1, (os.cpu_count() or 2) // 2)


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def physical_memory_available() -> int:
    """Bytes of RAM available for a CPU load (MemAvailable), or 0 if unknown."""
    return _meminfo("MemAvailable")


def physical_memory_total() -> int:
    return _meminfo("MemTotal")
