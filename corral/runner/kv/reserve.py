"""The cap's context, made ahead and kept uncommitted: a burst at an idle model adopts it
between two steps instead of waiting for one to be built.

Making a context of sixteen streams takes llama.cpp 0.7-2.3 s here, and longer while
the cores prefill the burst's prompt, because it allocates the whole KV buffer and
clears it, touching every page; meanwhile the burst runs one request at a time in the
idle context's single slot. So the reserve is made once, after the engine's first rest,
and its pages are handed back to the kernel with madvise(MADV_DONTNEED). For private
anonymous memory that leaves the contents zero, which is what the clear wrote, and
commits nothing until a page is written again: the reserve costs address space, not
RSS, and once adopted its memory follows the cells its sequences fill. When the engine
shrinks away from it, its cells are emptied and its pages handed back again.

Nothing of this makes a request wait. The context is made on a builder thread, with
the GIL released, while the engine serves from the one it has. Its KV pages are found
without an API for them: the mappings that appeared while it was made, at least
MIN_MAPPING long, whose pages are resident (the clear wrote them) and read as zero, in
runs of at least MIN_RUN. A build during which any other context was made or freed
(growth, the embedding context: counted by runner.llama.native) is thrown away and tried
again at the next rest, since a new context's KV would look the same. The engine thread
does the looking and the handing back, a piece at a time while nothing waits on its
queue, so the pages it reads are never written by the engine meanwhile, and a request
that arrives finds it between two pieces. Only where the KV is in host memory (no
offloaded layers) and /proc/self/maps exists (Linux); elsewhere the engine grows on
demand as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import mmap
import threading
from typing import TYPE_CHECKING, Any, Callable

import llama_cpp as L
import numpy as np

from corral.errors import RunnerError
from corral.runner.llama import native

if TYPE_CHECKING:
    from corral.runner.llama.context import LlamaContext

log = logging.getLogger("corral.reserve")

MIN_MAPPING = 64 << 20
MIN_RUN = 1 << 20  # a KV buffer is one run of zero pages; stray zero pages elsewhere are not
PIECE = 16 << 20  # bytes looked at or handed back between two looks at the queue
GATE_WAIT = 300.0  # seconds a test's gate may hold the build
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


def pieces(ranges: list[Range], size: int = PIECE) -> list[Range]:
    """Each range less its first and last page (malloc keeps a chunk header there), cut
    into pieces of at most `size` bytes: the engine looks at one between two commands."""
    out = []
    for start, end in ranges:
        first, last = start + PAGE, end - PAGE
        out += [(a, min(a + size, last)) for a in range(first, last, size)]
    return out


def zero_pages(piece: Range) -> list[Range]:
    """The runs of whole pages in `piece` that are resident and read as zero. Both the
    residency (mincore) and the copy are made holding the GIL (ctypes.PyDLL, string_at),
    so no Python object in that memory is freed between them; an unmapped piece has none."""
    start, end = piece
    pages = (end - start) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _mincore(start, end - start, vec) != 0:
        return []
    resident = np.frombuffer(bytes(vec), dtype=np.uint8) & 1
    zero = np.zeros(pages, dtype=bool)
    for a, b in _runs_of(resident.astype(bool)):
        words = np.frombuffer(ctypes.string_at(start + a * PAGE, (b - a) * PAGE), np.uint64)
        zero[a:b] = ~words.reshape(b - a, PAGE // 8).any(axis=1)
    return [(start + a * PAGE, start + b * PAGE) for a, b in _runs_of(zero)]


def zero_runs(ranges: list[Range], least: int = PAGE) -> list[Range]:
    """The runs of at least `least` bytes of resident pages that read as zero, inside
    each range less its first and last page."""
    return joined([r for p in pieces(ranges) for r in zero_pages(p)], least)


def joined(runs: list[Range], least: int) -> list[Range]:
    """Adjacent runs (from consecutive pieces) as one; those shorter than `least` left out."""
    out: list[Range] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return [r for r in out if r[1] - r[0] >= least]


def _runs_of(flags: Any) -> list[Range]:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _mincore(address: int, length: int, vec: Any) -> int:
    global _mincore_fn
    if _mincore_fn is None:
        fn = ctypes.PyDLL(None).mincore  # PyDLL: the GIL stays held
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _mincore_fn = fn
    return int(_mincore_fn(address, length, vec))


_mincore_fn: Any = None


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
    """One context of `streams` streams, made on a builder thread after the engine's
    first rest and held uncommitted; a resize takes it (any thread) and gives it back
    when shrinking. `gate`, for tests, holds the build until it is set."""

    def __init__(self, llama: LlamaContext, streams: int,
                 gate: threading.Event | None = None) -> None:
        self.llama, self.streams, self.gate = llama, streams, gate
        self._lock = threading.Lock()
        self._ctx: Any = None  # made, its pages found: ready to take
        self._runs: list[Range] = []  # its KV pages (those that read as zero when made)
        self._owned: Any = None  # the reserve's context while the engine serves from it
        self._made: Any = None  # made on the builder thread; its pages not looked at yet
        self._scan: list[Range] = []  # pieces still to look at, and the runs found so far
        self._found: list[Range] = []
        self._todo: list[Range] = []  # pieces of runs still to hand back
        self._thread: threading.Thread | None = None
        self._closed = False
        self.pending = True  # not yet tried (or to try again)
        self.tried = threading.Event()  # set once the first try is over: made, or not

    @property
    def building(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, wake: Callable[[], None]) -> None:
        """Engine thread, at rest: make the reserve on a builder thread, which calls
        `wake` when done (the engine, idle, then looks at its pages)."""
        self.pending = False
        self._thread = threading.Thread(target=self._make, args=(wake,), daemon=True,
                                        name="kv-reserve")
        self._thread.start()

    def _make(self, wake: Callable[[], None]) -> None:
        # At the lowest priority: making the context clears its KV, a second or more of one
        # core, and a request that arrives meanwhile must not share its cores with that.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._try()
        finally:
            wake()

    def _try(self) -> None:
        if self.gate is not None:
            self.gate.wait(GATE_WAIT)
        if self._closed:
            return
        try:
            made = native.contexts_made()  # read before the mappings, and after them
            before = mappings()
            ctx = self.llama.new_context(self.streams)
            ranges = appeared(before, mappings(), MIN_MAPPING)
        except RunnerError as exc:
            log.debug("KV reserve not made: %s", exc.message)
            self.tried.set()
            return
        if native.contexts_made() != made + 2 or self._closed:  # ours began and ended
            log.debug("KV reserve: another context came or went meanwhile; tried again later")
            self.llama.discard(ctx)
            self.pending = not self._closed
            return
        with self._lock:
            self._made, self._scan, self._found = ctx, pieces(ranges), []

    def settle(self, waiting: Callable[[], bool]) -> None:
        """Engine thread, at rest: look at the new context's pages, then hand them back,
        a piece at a time, until done or `waiting()` (a command is on the queue)."""
        while not waiting() and self._piece():
            pass

    def _piece(self) -> bool:
        """One piece of work; False when there is none."""
        with self._lock:
            if self._scan:
                piece = self._scan.pop(0)
            elif self._made is not None:
                self._found_all()
                return True
            elif self._todo:
                release([self._todo.pop(0)])
                if not self._todo:
                    self.tried.set()
                return True
            else:
                return False
        try:
            found = zero_pages(piece)
        except (OSError, ValueError, ctypes.ArgumentError):  # never the engine's end
            log.exception("KV reserve: could not look at its pages")
            with self._lock:
                self._scan, self._found = [], []
            return True
        with self._lock:
            self._found += found
        return True

    def _found_all(self) -> None:
        """Every piece looked at (lock held): keep the context if its KV was found."""
        ctx, self._made = self._made, None
        runs = joined(self._found, MIN_RUN)
        if not runs:
            log.debug("KV reserve: nothing to hand back; the engine builds on demand")
            self.llama.discard(ctx)
            self.tried.set()
            return
        self._ctx, self._runs, self._todo = ctx, runs, cut(runs, PIECE)

    def take(self) -> Any:
        """The reserve's context, or None while there is none to give. Its pages not yet
        handed back stay committed (the engine will write them)."""
        with self._lock:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                self._owned, self._todo = ctx, []
                self.tried.set()
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
        """Engine thread, moved off `ctx`: empty its cells; its pages are handed back at
        the next rest (settle), unless a burst takes it again first."""
        L.llama_memory_clear(L.llama_get_memory(ctx), False)
        with self._lock:
            self._owned, self._ctx, self._todo = None, ctx, cut(self._runs, PIECE)

    def free(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            held = [c for c in (self._ctx, self._made) if c is not None]
            self._ctx = self._made = None
        for ctx in held:
            self.llama.discard(ctx)


def cut(runs: list[Range], size: int) -> list[Range]:
    """Runs in pieces of at most `size` bytes."""
    return [(a, min(a + size, end)) for start, end in runs for a in range(start, end, size)]
