"""How long the engine thread has been inside the step it is in: progress, not presence.

A thread blocked in native code (llama_decode waiting on an RPC worker that stopped
answering, a hung GPU driver, a draft model's decode) looks alive forever, and the
HTTP thread that answers /health would go on saying so. The engine thread marks each
step it enters and leaves (an embedding slice and a decode step, with the draft model's
proposals and the image slice: every call into llama.cpp that serves a request); the
runner's watchdog thread (runner.process.main) reads the mark, and past the bound
(CORRAL_STEP_TIMEOUT) declares the engine stalled. Housekeeping between steps (a resize
moving onto a new context, the reserve's pages) is not watched."""

from __future__ import annotations

import time
from typing import Callable


class StepWatch:
    """Written by the engine thread only, read by any: one float, so no lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None  # when the step now running began; None: none is

    def enter(self) -> None:
        self._since = self._clock()

    def leave(self) -> None:
        self._since = None

    def running_for(self) -> float:
        """Seconds inside the current step; 0 between steps (idle or waiting for work)."""
        since = self._since
        return 0.0 if since is None else max(0.0, self._clock() - since)
