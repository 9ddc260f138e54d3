"""The engine's scheduler: which waiting sequence runs next, on which slot, and where the
KV of its prompt's prefix comes from. (The daemon's scheduler, server.scheduler, decides
which models are loaded; this one works inside one model's engine.)

Each engine step reads schedule -> run -> postprocess (runner.engine); this is the
first part's policy. It owns the waiting queue (new and preempted sequences, oldest
first) and, for the next sequence it admits, picks the source of its prefix, the one
that saves the most prefill:

    REUSE    the idle slot's own cached tokens: nothing to copy
    BRANCH   a prefix another slot holds, copied across (a request running with the
             same system prompt, tools or document)
    RESTORE  an entry of the prompt cache (runner.promptcache), or of its disk tier
    NONE     nothing shared: prefill from the start

A copy costs something, so BRANCH and RESTORE must beat REUSE by MIN_GAIN tokens. A new
sequence whose prefix a prefilling slot is about to compute is HELD until it has, then
branches from it: sixteen requests sharing an agent's system prompt prefill it once,
which also covers the first burst at an idle model while its context grows. Pure: it
reads slots and the caches and returns decisions; the engine makes the native calls.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.errors import CorralError
from corral.runner.admission import align_keep, fit_prompt
from corral.runner.caches import PrefixCaches
from corral.runner.promptcache import Entry
from corral.runner.sequence import SeqState
from corral.runner.slot import Slot, SlotState, common_prefix

if TYPE_CHECKING:
    from corral.runner.diskcache import DiskEntry
    from corral.runner.kvpool import KVPool
    from corral.runner.sequence import Sequence

MIN_GAIN = 32  # tokens a copy must save over reusing the slot's own cache
HOLD_MIN = 64  # tokens a prefilling slot must be about to compute for a sequence to wait on it


class Source(enum.Enum):
    NONE = "none"
    REUSE = "reuse"
    BRANCH = "branch"
    RESTORE = "restore"


@dataclass(frozen=True)
class Placement:
    """A decision: `seq` runs on `slot`, whose first `keep` tokens of `tokens` come from
    `source` (the donor slot, or the cache entry) and the rest are prefilled."""

    seq: "Sequence"
    slot: Slot
    tokens: list[int]
    keep: int
    source: Source
    donor: Slot | None = None
    entry: Entry | None = None
    disk: "DiskEntry | None" = None


@dataclass(frozen=True)
class Refusal:
    """A sequence that cannot run at all (its prompt does not fit): it fails alone."""

    seq: "Sequence"
    error: CorralError


class Scheduler:
    def __init__(self, num_ctx: int, caches: PrefixCaches, pool: "KVPool | None" = None) -> None:
        self.num_ctx, self.caches, self.pool = num_ctx, caches, pool
        self.waiting: deque["Sequence"] = deque()  # new and preempted, oldest first

    def add(self, seq: "Sequence") -> None:
        self.waiting.append(seq)

    def requeue(self, seq: "Sequence") -> None:
        """A preempted sequence goes back to the front: it is the oldest."""
        self.waiting.appendleft(seq)

    def next(self, slots: list[Slot]) -> Placement | Refusal | None:
        """The next sequence to admit, in order, skipping those held for a prefix being
        computed; None when nothing can start now."""
        idle = [s for s in slots if s.state is SlotState.IDLE]
        for seq in list(self.waiting):
            if not idle:
                return None
            if self.pool is not None and not self.pool.admits(slots, self._need(seq)):
                return None  # no room in the pool yet: it and everything behind it wait
            resuming = seq.state is SeqState.PREEMPTED
            try:
                tokens = fit_prompt(seq.job, seq.generated if resuming else [], self.num_ctx)
            except CorralError as exc:  # ContextOverflow: this request's 400 alone
                self.waiting.remove(seq)
                return Refusal(seq, exc)
            placement = self._place(seq, tokens, idle, slots)
            if placement is not None:
                self.waiting.remove(seq)
                return placement
        return None

    def _need(self, seq: "Sequence") -> int:
        return min(len(seq.job.prompt) + len(seq.generated), self.num_ctx)

    def _place(self, seq: "Sequence", tokens: list[int], idle: list[Slot],
               slots: list[Slot]) -> Placement | None:
        # At least one prompt token must be decoded to get logits; a prefix may not end
        # inside an image whose tokens attend both ways.
        def usable(n: int) -> int:
            return align_keep(seq.job.images, min(n, len(tokens) - 1))

        # The idle slot sharing the longest prefix; ties go to the least recently used.
        reuse, _, slot = max(((common_prefix(s.reusable(), tokens), -s.last_used, s)
                              for s in idle), key=lambda c: (c[0], c[1]))
        reuse = usable(reuse)
        best = Placement(seq, slot, tokens, reuse, Source.REUSE if reuse else Source.NONE)
        busy = [s for s in slots if s.state is not SlotState.IDLE and not s.tainted]
        # The slot a copy goes to: the one whose own cache is worth least.
        target = min(idle, key=lambda s: (len(s.reusable()), s.last_used))
        for donor in busy:
            n = usable(common_prefix(donor.cached, tokens))
            if n >= best.keep + MIN_GAIN:
                best = Placement(seq, target, tokens, n, Source.BRANCH, donor=donor)
        hit = self.caches.lookup(tokens)
        if (hit.entry or hit.disk) and usable(hit.n) >= best.keep + MIN_GAIN:
            best = Placement(seq, target, tokens, usable(hit.n), Source.RESTORE,
                             entry=hit.entry, disk=hit.disk)
        if seq.state is SeqState.WAITING and self._worth_holding(tokens, busy, best.keep):
            return None
        return best

    @staticmethod
    def _worth_holding(tokens: list[int], busy: list[Slot], have: int) -> bool:
        """Whether a prefilling slot is about to compute at least HOLD_MIN more of this
        prompt's prefix than is at hand now."""
        for slot in busy:
            if slot.state is not SlotState.PREFILL:
                continue
            ahead = common_prefix(slot.cached + slot.pending, tokens)
            if ahead > len(slot.cached) and ahead >= have + HOLD_MIN:
                return True
        return False
