"""The uncommitted reserve (runner.kv.reserve): ggml as install.sh builds it hands a
cleared buffer's pages back and logs them, and with the real model a burst adopts the
reserve in one step, outputs unchanged, memory handed back when it shrinks."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from corral.runner.kv.reserve import possible
from corral.runner.llama import native

PAGE = mmap.PAGESIZE
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs madvise")


def _rss(address: int, pages: int) -> int:
    """Resident pages among those that [address, address + pages * PAGE) touches (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = address - address % PAGE
    n = (address + pages * PAGE - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec) == 0
    return sum(v & 1 for v in vec)


def _resident(runs: list[tuple[int, int]]) -> int:
    return sum(_rss(start, (end - start) // PAGE) for start, end in runs)


def _ggml() -> Any:
    """ggml's buffer calls, typed (llama-cpp-python binds none of them)."""
    import llama_cpp.llama_cpp as LL

    lib, p, n = LL._lib, ctypes.c_void_p, ctypes.c_size_t
    for name, args, res in [("ggml_backend_cpu_buffer_type", [], p),
                            ("ggml_backend_buft_alloc_buffer", [p, n], p),
                            ("ggml_backend_cpu_buffer_from_ptr", [p, n], p),
                            ("ggml_backend_buffer_get_base", [p], p),
                            ("ggml_backend_buffer_clear", [p, ctypes.c_uint8], None),
                            ("ggml_backend_buffer_free", [p], None)]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@linux
def test_a_zero_clear_hands_the_pages_back_reads_zero_and_is_logged() -> None:
    assert possible(), "ggml is not built by install.sh: its clear writes every page"
    g, size = _ggml(), 8 << 20
    buf = g.ggml_backend_buft_alloc_buffer(g.ggml_backend_cpu_buffer_type(), size)
    try:
        base = g.ggml_backend_buffer_get_base(buf)
        ctypes.memset(base, 0xAB, size)
        pages = size // PAGE
        assert _rss(base, pages) >= pages
        before = native.cleared()
        assert before is not None
        g.ggml_backend_buffer_clear(buf, 0)
        n, runs = native.cleared(before[0])  # type: ignore[misc]
        ours = [(a, b) for a, b in runs if base <= a < base + size]  # (other threads clear too)
        assert len(ours) == 1
        first, last = ours[0]
        assert base <= first < base + PAGE and base + size - PAGE <= last <= base + size
        assert _rss(base, pages) <= 2  # at most the two edge pages, which were written
        assert ctypes.string_at(base, size).count(0) == size
        g.ggml_backend_buffer_clear(buf, 7)  # not zero: written, as before, and not logged
        assert ctypes.string_at(base, size).count(7) == size
        assert not [a for a, _ in native.cleared(n)[1] if base <= a < base + size]  # type: ignore[index]
    finally:
        g.ggml_backend_buffer_free(buf)


@linux
def test_a_buffer_over_a_callers_pointer_is_written_not_handed_back(tmp_path: Path) -> None:
    """A model file's private mapping would read the file again after MADV_DONTNEED."""
    assert possible(), "ggml is not built by install.sh"
    g, size = _ggml(), 4 << 20
    path = tmp_path / "weights"
    path.write_bytes(b"\x11" * size)
    with open(path, "r+b") as f:
        area = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    buf = g.ggml_backend_cpu_buffer_from_ptr(base, size)
    try:
        count = native.cleared()[0]  # type: ignore[index]
        g.ggml_backend_buffer_clear(buf, 0)
        assert area[:].count(0) == size
        assert not [a for a, _ in native.cleared(count)[1]  # type: ignore[index]
                    if base <= a < base + size]
    finally:
        g.ggml_backend_buffer_free(buf)
        del base
        area.close()


@pytest.fixture(scope="module")
def reserved(starter_gguf: Path) -> Iterator[object]:
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine

    # 4 x 2,048 cells of the base starter: ~150 MB of KV.
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
        "the reserve was not made"
    # Measured on the reserve's own KV pages (mincore), not the process's RSS: this
    # process also runs other tests' daemons and threads, whose memory moves by tens of
    # megabytes on its own (it failed a clean-clone run by 1 MB of 75).
    from corral.runner.llama.context import _address

    made = reserve._ctx if reserve._ctx is not None else reserve._owned
    runs = engine.llama._kv_pages[_address(made)]
    pages = sum((end - start) // PAGE for start, end in runs)
    kv = 4 * 2048 * 18 * 1024  # bytes of f16 K and V per cell for this model, x cells
    assert pages * PAGE > kv // 2  # the runs are the KV buffer's
    if reserve._ctx is not None:  # made and not yet taken: nothing of it committed
        assert _resident(runs) < pages // 100
        # What ps counts (runner.kv.growth): the pages the cells the one stream in use
        # wrote (each layer's K and V rows, a page or more each), far from its whole
        # buffer (kv // 4), which a stock clear would have committed.
        assert 0 < engine.kv_held(kv) < kv // 16
    assert engine.status()["reserve_streams"] == 4
    assert run_together(engine, [(p, 20, {}) for p in PROMPTS]) == alone
    # At the cap through the reserve (requests that arrive apart may build a tier first).
    assert engine.status()["slots"] == 4 and reserve.owns(engine.llama.ctx)
    assert _resident(runs) > 0  # in use: the cells written are committed
    assert 0 < engine.kv_held(kv) == reserve.committed() < kv // 2  # the cells written
    engine.resizer.capacity.shrink_after = 0.5
    _wait(lambda: engine.status()["slots"] == 1, "shrinks after shrink_after")
    assert reserve._ctx is not None and not reserve.owns(engine.llama.ctx)  # put back
    assert _resident(runs) < pages // 100  # handed back by the clear, at once
    # Shrunk: the pages of the cells copied into a context of one stream, not its whole
    # buffer (kv // 4).
    assert 0 < engine.kv_held(kv) < kv // 16
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


def _huge_pages_possible() -> bool:
    """Whether this kernel gives transparent huge pages to memory advised MADV_HUGEPAGE."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


@linux
def test_a_kv_buffer_kept_in_base_pages_commits_the_pages_written_not_2_mb_each() -> None:
    """Where transparent huge pages are on for all memory (THP `always`, as MADV_HUGEPAGE
    makes it here), a byte written commits the 2 MB around it: a buffer with one cell
    written per layer fills. small_pages keeps the commit to the pages written."""
    from corral.process import small_pages

    if not _huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages")
    libc, g, size = ctypes.CDLL(None, use_errno=True), _ggml(), 16 << 20
    resident = []
    for keep_small in (False, True):
        buf = g.ggml_backend_buft_alloc_buffer(g.ggml_backend_cpu_buffer_type(), size)
        try:
            base = g.ggml_backend_buffer_get_base(buf)
            count = native.cleared()[0]  # type: ignore[index]
            g.ggml_backend_buffer_clear(buf, 0)
            runs = [(a, b) for a, b in native.cleared(count)[1]  # type: ignore[index]
                    if base <= a < base + size]
            for start, end in runs:  # as THP `always` treats every anonymous mapping
                assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                    mmap.MADV_HUGEPAGE) == 0
            if keep_small:
                small_pages(runs)
            for at in range(0, size, 1 << 20):  # a byte in every megabyte
                ctypes.memset(base + at, 1, 1)
            resident.append(_resident(runs))
        finally:
            g.ggml_backend_buffer_free(buf)
    if resident[0] <= 64:
        pytest.skip("the kernel had no huge page free to give: nothing to keep small")
    assert resident[1] <= 16 + 2  # a page per megabyte written (and the edges)


@linux
@pytest.mark.model
def test_every_kv_buffer_of_the_engine_is_kept_in_base_pages(reserved: object) -> None:
    """The serving context's and the reserve's KV pages carry the no-huge-pages advice
    (VmFlags `nh`), so that they commit as the cells are written on any THP setting."""
    from corral.runner.engine.engine import Engine
    from corral.runner.llama.context import _address

    if not _huge_pages_possible():
        pytest.skip("this kernel gives no transparent huge pages")
    engine = reserved
    assert isinstance(engine, Engine)
    runs = [r for runs in engine.llama._kv_pages.values() for r in runs]
    assert _address(engine.llama.ctx) in engine.llama._kv_pages and runs
    areas = []  # (start, end, flags) of each mapping
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ")[0]  # "start-end" opens a mapping; "Name:" is one of its fields
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
        elif line.startswith("VmFlags:"):
            areas.append((start, end, line.split()[1:]))
    for first, last in runs:
        covering = [flags for start, end, flags in areas if start < last and end > first]
        assert covering and all("nh" in flags for flags in covering), (first, covering)
