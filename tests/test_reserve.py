"""The uncommitted reserve (runner.kv.reserve): finding new mappings, handing back only
zero pages, and with the real model a burst that adopts the reserve in one step,
outputs unchanged, memory handed back when it shrinks."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from corral.runner.kv.reserve import PAGE, appeared, release, zero_runs

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def test_new_ranges_are_address_intervals_not_listing_entries() -> None:
    before = [(0, 100, True), (500, 600, False)]
    # The kernel merged a new mapping with the one before it, and one grew into a
    # reserved (non-writable) range: only the addresses nothing held before count.
    after = [(0, 300, True), (500, 600, True), (700, 720, True), (800, 1000, False)]
    assert appeared(before, after, floor=50) == [(100, 300)]
    assert appeared(before, after, floor=10) == [(100, 300), (700, 720)]
    assert appeared(after, after, floor=1) == []


def _rss(address: int, pages: int) -> int:
    """Resident pages of [address, address + pages * PAGE) (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(pages * PAGE), vec) == 0
    return sum(v & 1 for v in vec)


@linux
def test_only_whole_zero_pages_are_handed_back_and_they_read_as_zero() -> None:
    pages = 64
    # Private, as malloc maps a large buffer (Python's default here would be shared).
    area = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    area.write(b"\0" * pages * PAGE)  # committed, as llama.cpp's clear leaves the KV
    area[10 * PAGE + 7] = 1  # live data in pages 10 and 40
    area[40 * PAGE] = 2
    runs = zero_runs([(base, base + pages * PAGE)])
    assert runs == [(base + PAGE, base + 10 * PAGE), (base + 11 * PAGE, base + 40 * PAGE),
                    (base + 41 * PAGE, base + 63 * PAGE)]  # first and last page kept
    assert _rss(base, pages) == pages
    assert release(runs)
    assert _rss(base, pages) == 4  # the two live pages, the first and the last
    assert area[10 * PAGE + 7] == 1 and area[40 * PAGE] == 2
    assert area[PAGE: 63 * PAGE].count(b"\0") == 62 * PAGE - 2
    del base
    area.close()


def _resident(runs: list[tuple[int, int]]) -> int:
    return sum(_rss(start, (end - start) // PAGE) for start, end in runs)


class _Llama:
    """Makes 'contexts' that are what a KV buffer is after llama.cpp's clear: a private
    anonymous mapping written with zeros (counted as a context is, by runner.llama.native)."""

    def __init__(self, size: int) -> None:
        self.size, self.made, self.freed = size, [], []  # type: ignore[var-annotated]

    def new_context(self, streams: int) -> mmap.mmap:
        from corral.runner.llama import native

        with native.context_event():
            area = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for _ in range(self.size >> 20):  # committed, a megabyte at a time
                area.write(bytes(1 << 20))
        self.made.append(area)
        return area

    def discard(self, ctx: mmap.mmap) -> None:
        self.freed.append(ctx)


@linux
def test_the_reserve_is_made_off_the_engine_and_settled_in_pieces_that_yield() -> None:
    from corral.runner.kv.reserve import PIECE, Reserve

    llama = _Llama(6 * PIECE)
    woken = threading.Event()
    reserve = Reserve(llama, 16)  # type: ignore[arg-type]
    reserve.start(woken.set)  # returns at once; the builder thread wakes the engine
    assert woken.wait(60) and not reserve.pending and len(llama.made) == 1
    looks: list[int] = []

    def waiting() -> bool:  # a command arrives after two pieces
        looks.append(1)
        return len(looks) > 2

    reserve.settle(waiting)  # the third look at the queue stops the work
    assert len(looks) == 3 and not reserve.ready() and not reserve.tried.is_set()
    reserve.settle(lambda: False)  # at rest again: the rest of it
    assert reserve.ready() and reserve.tried.is_set() and llama.freed == []
    runs = list(reserve._runs)
    assert sum(b - a for a, b in runs) == 6 * PIECE - 2 * PAGE  # all but the ends
    assert _resident(runs) == 0
    assert reserve.take() is llama.made[0] and not reserve.ready()
    llama.made[0].close()


@pytest.fixture(scope="module")
def reserved(starter_gguf: Path) -> Iterator[object]:
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine

    # 4 x 2,048 cells of the base starter: ~150 MB of KV, above reserve.MIN_MAPPING.
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=4, start_slots=1, num_ctx=2048,
                                                 deterministic=True))
    eng.resizer.capacity.shrink_after = 3600  # type: ignore[union-attr]  # the test says when
    eng.start()
    yield eng
    eng.stop()


def _wait(check: object, what: str) -> None:
    deadline = time.monotonic() + 60
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@linux
@pytest.mark.model
def test_a_burst_adopts_the_reserve_and_shrinking_hands_its_memory_back(
        reserved: object) -> None:
    from corral.runner.engine.engine import Engine
    from tests.test_engine import PROMPTS, run, run_together

    engine = reserved
    assert isinstance(engine, Engine) and engine.resizer is not None
    reserve = engine.resizer.reserve
    assert reserve is not None and reserve.pending  # nothing is made before a request
    alone = [run(engine, p, 20)[0] for p in PROMPTS]
    assert reserve.tried.wait(60), "the reserve is made when idle"
    # Made; prompts that came one after another may already serve from it (each kept its
    # stream as a warm conversation: runner.kv.growth), which commits only what they wrote.
    assert reserve._ctx is not None or reserve.owns(engine.llama.ctx), \
        "the KV mapping was not found"
    # Measured on the reserve's own KV pages (mincore), not the process's RSS: this
    # process also runs other tests' daemons and threads, whose memory moves by tens of
    # megabytes on its own (it failed a clean-clone run by 1 MB of 75).
    runs = list(reserve._runs)
    pages = sum((end - start) // PAGE for start, end in runs)
    kv = 4 * 2048 * 18 * 1024  # bytes of f16 K and V per cell for this model, x cells
    assert pages * PAGE > kv // 2  # the runs are the KV buffer's
    if reserve._ctx is not None:  # made and not yet taken: nothing of it committed
        assert _resident(runs) < pages // 100
        # What ps counts (runner.kv.growth): the one stream in use, whole, and no more.
        assert kv // 4 <= engine.kv_held(kv) < kv // 4 + kv // 100
    assert engine.status()["reserve_streams"] == 4
    assert run_together(engine, [(p, 20, {}) for p in PROMPTS]) == alone
    # At the cap through the reserve (requests that arrive apart may build a tier first).
    assert engine.status()["slots"] == 4 and reserve.owns(engine.llama.ctx)
    assert _resident(runs) > 0  # in use: the cells written are committed
    assert 0 < engine.kv_held(kv) == reserve.committed() < kv // 2  # the cells written
    engine.resizer.capacity.shrink_after = 0.5
    _wait(lambda: engine.status()["slots"] == 1, "shrinks after shrink_after")
    assert reserve._ctx is not None and not reserve.owns(engine.llama.ctx)  # put back
    _wait(lambda: _resident(runs) < pages // 100, "handed back at the next rest")
    # Shrunk: a built context of one stream, whole, beside the reserve's few pages.
    assert kv // 4 <= engine.kv_held(kv) < kv // 4 + kv // 100
    engine.resizer.capacity.shrink_after = 3600
    assert run_together(engine, [(p, 20, {}) for p in PROMPTS]) == alone  # cells emptied
    assert engine.status()["slots"] == 4 and reserve.owns(engine.llama.ctx)


@linux
@pytest.mark.model
def test_a_request_runs_while_the_reserve_is_being_built(starter_gguf: Path) -> None:
    """The reserve is made off the engine thread: with its build held by a gate, a
    request sent after the first one gets its tokens and ends; then the build finishes."""
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine
    from tests.support import wait_for
    from tests.test_engine import PROMPTS, run

    gate = threading.Event()
    engine = Engine(str(starter_gguf), EngineConfig(n_slots=4, start_slots=1, num_ctx=2048,
                                                    deterministic=True), reserve_gate=gate)
    assert engine.resizer is not None and engine.resizer.reserve is not None
    reserve = engine.resizer.reserve
    engine.start()
    try:
        run(engine, PROMPTS[0], 4)
        wait_for(lambda: not reserve.pending, timeout=60)  # the first rest began it
        text, stats = run(engine, PROMPTS[1], 8)  # meanwhile, held at the gate
        assert text and stats.eval_count == 8
        assert not reserve.tried.is_set()  # the request did not wait for the build
        gate.set()
        assert reserve.tried.wait(120), "the build goes on once the gate opens"
        assert reserve.ready() or reserve.owns(engine.llama.ctx)
    finally:
        gate.set()
        engine.stop()
