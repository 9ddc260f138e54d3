"""How long the engine thread has been inside the step it is in: progress, not presence.

A thread blocked in native code (llama_decode waiting on an RPC worker that stopped
answering, a hung GPU driver, a draft model's decode) looks alive forever, and the
HTTP thread that answers /health would go on saying so. The engine thread marks each
step it enters and leaves (an embedding slice and a decode step, with the draft model's
proposals and the image slice: every call into llama.cpp that serves a request), and a
resize's move onto a new context (its sequence copies wait on the same devices); the
runner's watchdog thread (runner.process.main) reads the mark, and past the bound
(CORRAL_STEP_TIMEOUT) declares the engine stalled. The first step after the load has a
grace of its own (FIRST_GRACE times the bound): it pages the weights in from disk, which
a large model on a slow disk takes minutes over. The reserve's pages, made on a builder
thread, are not watched; the media encode thread is, by its own mark
(runner.llama.vision), a StepWatch of its own around each native call."""

from __future__ import annotations

import time
from typing import Callable


FIRST_GRACE = 4  # the first step's bound, in bounds: the weights page in from disk


class StepWatch:
    """Written by the engine thread only, read by any: one float, so no lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 first_grace: bool = True) -> None:
        self._clock = clock
        self._since: float | None = None  # when the step now running began; None: none is
        self.what = "one step"  # what is running, for the stall's message
        self.first = first_grace  # no step has ended yet: the one running is the first

    def enter(self, what: str = "one step") -> None:
        self.what = what
        self._since = self._clock()

    def leave(self, worked: bool = True) -> None:
        """Out of the call; `worked`: it did the work the first step's grace is for (an
        idle pass of the loop, or a resize, does not)."""
        self._since = None
        self.first = self.first and not worked

    def bound(self, step_timeout: float) -> float:
        """The bound on the step running now: the first's is FIRST_GRACE times longer."""
        return step_timeout * FIRST_GRACE if self.first else step_timeout

    def running_for(self) -> float:
        """Seconds inside the current step; 0 between steps (idle or waiting for work)."""
        since = self._since
        return 0.0 if since is None else max(0.0, self._clock() - since)
