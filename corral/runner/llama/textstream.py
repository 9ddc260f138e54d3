"""Turning sampled token bytes into safe streamed text.

Two concerns, both pure: a token may end in the middle of a multi-byte UTF-8
character (buffer until it completes), and text that could still become a stop
string must be held back (a stop string is never emitted, even in part).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


class Utf8Stream:
    """Incremental UTF-8 decoding; never returns a partial character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched; generation must end


class StopMatcher:
    """Holds back any suffix that is a prefix of a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> StopResult:
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return StopResult(buf, False)
        first = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self._held = ""
            return StopResult(buf[:first], True)
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return StopResult(buf[: len(buf) - keep], False)

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that starts some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if stop.startswith(buf[-n:]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation, held text that never became a stop is real output."""
        held, self._held = self._held, ""
        return held
