"""The cap's context, made ahead: a burst at an idle model adopts it between two steps
instead of waiting for one to be built.

Making a context of sixteen streams takes llama.cpp a while (a graph reserved for each
batch shape), and it clears the whole KV buffer. Stock ggml's clear writes every page:
0.7-2.3 s here, and the whole cap's KV committed (1.6 GB for a 135M model) whether or
not a second request ever came. install.sh builds ggml so that a zero clear of a CPU
buffer hands its pages back with madvise(MADV_DONTNEED) instead: for private anonymous
memory they read as zero and commit nothing until written. So the reserve costs
address space, not RSS; what it holds is its KV pages in memory now, the cells its
sequences wrote (LlamaContext.kv_committed). When the engine shrinks away from it, its
cells are emptied with llama_memory_clear(data=True), which hands them back again.

Nothing of this makes a request wait: the context is made on a builder thread, with the
GIL released, at the lowest priority, while the engine serves from the one it has. Only
where ggml is built so (Linux) and the KV is host memory; elsewhere the engine grows on
demand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import llama_cpp as L

from corral.errors import RunnerError
from corral.runner.llama import native

if TYPE_CHECKING:
    from corral.runner.llama.context import LlamaContext

log = logging.getLogger("corral.reserve")

GATE_WAIT = 300.0  # seconds a test's gate may hold the build


def possible() -> bool:
    """Whether a context's KV commits nothing when made (install.sh's ggml, on Linux)."""
    return native.cleared() is not None


class Reserve:
    """One context of `streams` streams, made on a builder thread after the engine's
    first rest; a resize takes it (any thread) and gives it back when shrinking. `gate`,
    for tests, holds the build until it is set."""

    def __init__(self, llama: LlamaContext, streams: int,
                 gate: threading.Event | None = None) -> None:
        self.llama, self.streams, self.gate = llama, streams, gate
        self._lock = threading.Lock()
        self._ctx: Any = None  # made: ready to take
        self._owned: Any = None  # the reserve's context while the engine serves from it
        self._thread: threading.Thread | None = None
        self._closed = False
        self.pending = True  # not yet tried
        self.tried = threading.Event()  # set once the first try is over: made, or not

    def start(self) -> None:
        """Engine thread, at rest: make the reserve on a builder thread."""
        self.pending = False
        self._thread = threading.Thread(target=self._make, daemon=True, name="kv-reserve")
        self._thread.start()

    def _make(self) -> None:
        # At the lowest priority: a request that arrives meanwhile must not share its
        # cores with a build it does not need.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        self._try()

    def _try(self) -> None:
        if self.gate is not None:
            self.gate.wait(GATE_WAIT)
        if self._closed:
            return
        try:
            ctx = self.llama.new_context(self.streams)
        except RunnerError as exc:
            log.debug("KV reserve not made: %s", exc.message)
            self.tried.set()
            return
        if self._closed or self.llama.kv_committed(ctx) is None:
            # (its KV pages not logged: the clear wrote them, and ps could not count them)
            self.llama.discard(ctx)
            self.tried.set()
            return
        with self._lock:
            self._ctx = ctx
        self.tried.set()

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
        """Bytes of its KV pages in memory now (any thread): the cells its sequences
        wrote since it was made or put back."""
        with self._lock:
            ctx = self._ctx if self._ctx is not None else self._owned
        return (self.llama.kv_committed(ctx) or 0) if ctx is not None else 0

    def owns(self, ctx: Any) -> bool:
        return ctx is not None and ctx is self._owned

    def put_back(self, ctx: Any) -> None:
        """Engine thread, moved off `ctx`: empty its cells and hand their pages back (the
        clear does, as install.sh builds ggml), until a burst takes it again."""
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        with self._lock:
            self._owned, self._ctx = None, ctx

    def free(self) -> bool:
        """False if its build is still inside llama.cpp after the wait (the model stays)."""
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self.llama.discard(ctx)
        return self._thread is None or not self._thread.is_alive()
