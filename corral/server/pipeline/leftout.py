"""What a dialect takes from a client and leaves unapplied, said once per daemon.

Agents send every field and tool their own provider knows (hosted tools, context edits
Corral does not make); none of them is a 400. Each kind is logged the first time it is
left out, with the reason, so that a user reading the log learns why and the log does
not repeat it every request.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("corral.pipeline")

_said: set[str] = set()
_lock = threading.Lock()


def left_out(what: str, why: str) -> None:
    """Log `what` was left out, and `why`, unless it was already said."""
    with _lock:
        if what in _said:
            return
        _said.add(what)
    log.info("left out: %s (%s)", what, why)
