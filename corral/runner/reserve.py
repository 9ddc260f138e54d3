"""The cap's context, made ahead and kept uncommitted: a burst at an idle model adopts it
between two steps instead of waiting for one to be built.

Making a context of sixteen streams takes llama.cpp 0.7-2.3 s here, and longer while
the cores prefill the burst's prompt, because it allocates the whole KV buffer and
clears it, touching every page; meanwhile the burst runs one request at a time in the
idle context's single slot. So the reserve is made once, at the engine's first idle
moment after loading, and its pages are handed back to the kernel with
madvise(MADV_DONTNEED). For private anonymous memory that leaves the contents zero,
which is what the clear wrote, and commits nothing until a page is written again: the
reserve costs address space, not RSS, and once adopted its memory follows the cells
its sequences fill. When the engine shrinks away from it, its cells are emptied and its
pages handed back again, ready for the next burst.

Finding the pages without an API for them: the context is made on the engine thread
(so no step runs) through a call that keeps the GIL (so no other Python thread
allocates), and the pages handed back are those of mappings that appeared during that
call, at least MIN_MAPPING long, and still all zero. Only where the KV is in host
memory (no offloaded layers) and /proc/self/maps exists (Linux); elsewhere the engine
grows on demand as before. The price is one build at idle after each load, which a
request arriving in that second waits for.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from typing import TYPE_CHECKING, Any

import llama_cpp as L
import numpy as np

from corral.errors import RunnerError

if TYPE_CHECKING:
    from corral.runner.context import LlamaContext

log = logging.getLogger("corral.reserve")

MIN_MAPPING = 64 << 20
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE

Range = tuple[int, int]


def mappings() -> list[tuple[int, int, bool]]:
    """(start, end, anonymous and writable) for every mapping; empty without /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append((start, end, len(fields) == 5 and fields[1] == "rw-p"))
    return out


def appeared(before: list[tuple[int, int, bool]], after: list[tuple[int, int, bool]],
             floor: int) -> list[Range]:
    """Anonymous writable address ranges of at least `floor` bytes mapped in `after` and
    by nothing in `before`. The kernel merges adjacent mappings in its listing, so this
    subtracts address intervals rather than comparing entries."""
    old = sorted((s, e) for s, e, _ in before)
    out = []
    for start, end, anon in after:
        if not anon:
            continue
        pieces = [(start, end)]
        for s, e in old:
            if e <= start or s >= end:
                continue
            pieces = [p for a, b in pieces for p in ((a, min(b, s)), (max(a, e), b)) if p[0] < p[1]]
        out += [p for p in pieces if p[1] - p[0] >= floor]
    return out


def zero_runs(ranges: list[Range]) -> list[Range]:
    """The runs of whole pages that read as zero, inside each range less its first and
    last page (malloc keeps a chunk header there)."""
    runs = []
    for start, end in ranges:
        first, last = start + PAGE, end - PAGE
        if last <= first:
            continue
        pages = (last - first) // PAGE
        words = np.ctypeslib.as_array((ctypes.c_uint64 * (pages * PAGE // 8)).from_address(first))
        zero = ~words.reshape(pages, PAGE // 8).any(axis=1)
        edges = np.flatnonzero(np.diff(np.concatenate(([0], zero.astype(np.int8), [0]))))
        runs += [(first + int(a) * PAGE, first + int(b) * PAGE)
                 for a, b in zip(edges[::2], edges[1::2])]
    return runs


def resident(runs: list[Range]) -> int:
    """Bytes of the runs' pages in memory now (mincore): those written since they were
    handed back. A range no longer mapped counts nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for start, end in runs:
        vec = np.zeros((end - start) // PAGE, np.uint8)
        if libc.mincore(start, end - start, vec.ctypes.data) == 0:
            total += int(np.count_nonzero(vec & 1)) * PAGE
    return total


def release(runs: list[Range]) -> bool:
    """Hand the pages back to the kernel; they read as zero afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(libc.madvise(a, b - a, MADV_DONTNEED) == 0 for a, b in runs)


class Reserve:
    """One context of `streams` streams, made on the engine thread when idle and held
    uncommitted; a resize takes it (any thread) and gives it back when shrinking."""

    def __init__(self, llama: LlamaContext, streams: int) -> None:
        self.llama, self.streams = llama, streams
        self._lock = threading.Lock()
        self._ctx: Any = None
        self._runs: list[Range] = []
        self._owned: Any = None  # the reserve's context while the engine serves from it
        self.pending = True  # not yet tried
        self.tried = threading.Event()  # set once making it is over, made or not

    def build(self) -> None:
        """Engine thread, idle: make the reserve and hand its pages back."""
        self.pending = False
        try:
            self._build()
        finally:
            self.tried.set()

    def _build(self) -> None:
        try:
            before = mappings()
            ctx = self.llama.new_context(self.streams, hold_gil=True)
            ranges = appeared(before, mappings(), MIN_MAPPING)
        except RunnerError as exc:
            log.debug("KV reserve not made: %s", exc.message)
            return
        try:
            runs = zero_runs(ranges)
            ok = bool(runs) and release(runs)
        except (OSError, ValueError, ctypes.ArgumentError):  # never the engine's end
            log.exception("KV reserve: could not hand its pages back")
            ok = False
        if not ok:
            log.debug("KV reserve: nothing to hand back; the engine builds on demand")
            self.llama.discard(ctx)
            return
        with self._lock:
            self._ctx, self._runs = ctx, runs

    def take(self) -> Any:
        """The reserve's context, or None while there is none to give."""
        with self._lock:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                self._owned = ctx
            return ctx

    def ready(self) -> bool:
        """Made, and not in use: growth may take it instead of building."""
        with self._lock:
            return self._ctx is not None

    def made(self) -> bool:
        """Made, in use or not."""
        with self._lock:
            return self._ctx is not None or self._owned is not None

    def committed(self) -> int:
        """Bytes of the pages it handed back that are in memory again (any thread): the
        cells its sequences wrote since. Its first and last pages and the few it found
        not zero, never handed back, are left out: kilobytes beside a KV buffer."""
        with self._lock:
            runs = list(self._runs) if self._ctx is not None or self._owned is not None else []
        return resident(runs)

    def owns(self, ctx: Any) -> bool:
        return ctx is not None and ctx is self._owned

    def put_back(self, ctx: Any) -> None:
        """Engine thread, moved off `ctx`: empty its cells and hand its pages back."""
        L.llama_memory_clear(L.llama_get_memory(ctx), False)
        with self._lock:
            self._owned = None
            if release(self._runs):
                self._ctx = ctx
                return
        self.llama.discard(ctx)

    def free(self) -> None:
        with self._lock:
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self.llama.discard(ctx)
