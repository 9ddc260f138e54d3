"""Calls to runners that nobody waits for: a runner's share of the cores, a prompt cache to
drop. They go through one thread, so that a runner that does not answer (stopped, swapping,
wedged in native code) delays only these notes, never a request or the scheduler's lock.
A newer note for the same runner and purpose replaces one not yet sent: only the last
share of the cores matters."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable

log = logging.getLogger("corral.courier")


class Courier:
    def __init__(self) -> None:
        self._notes: dict[Hashable, Callable[[], None]] = {}  # in the order first sent
        self._cond = threading.Condition()
        self._delivering = False
        threading.Thread(target=self._run, name="courier", daemon=True).start()

    def send(self, key: Hashable, note: Callable[[], None]) -> None:
        """Deliver `note()` soon, after the notes before it; each call has its own deadline
        (the runner client's), so one stuck runner holds the others back by that much."""
        with self._cond:
            self._notes[key] = note
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._notes))
                key = next(iter(self._notes))
                note = self._notes.pop(key)
                self._delivering = True
            try:
                note()
            except Exception:  # a note that fails is lost; the next one may do better
                log.exception("a note to a runner failed")
            with self._cond:
                self._delivering = False

    @property
    def pending(self) -> int:
        """Notes not yet delivered, the one on its way included."""
        with self._cond:
            return len(self._notes) + self._delivering


def in_parallel(calls: list[Callable[[], object]], deadline: float) -> None:
    """Make each call on its own thread and return when all are done, or `deadline` (plus
    a second) has passed: one runner that does not answer delays nobody but this caller."""
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline + 1.0
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))


def stop_within(stop: Callable[[], None], deadline: float) -> bool:
    """Run a runner's `stop` (its own deadlines: a disk tier's write, then SIGKILL) and
    wait at most `deadline` seconds for it; False where it never returned (a process stuck
    in a driver, past even SIGKILL), so that the caller can go on without it."""
    stopper = threading.Thread(target=stop, name="runner-stop", daemon=True)
    stopper.start()
    stopper.join(deadline)
    return not stopper.is_alive()
