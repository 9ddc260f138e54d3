"""The engine's placer: which waiting sequence runs next, on which slot, and where the
KV of its prompt's prefix comes from. (The daemon's scheduler, server.residency.scheduler,
decides which models are loaded; the placer works inside one model's engine.)

Each engine step reads schedule -> run -> postprocess (runner.engine.engine); this is the
first part's policy. It owns the waiting queue (new and preempted sequences, oldest
first) and, for the next sequence it admits, picks the source of its prefix, the one
that saves the most prefill:

    REUSE    the idle slot's own cached tokens: nothing to copy
    BRANCH   a prefix another slot holds, copied across (a request running with the
             same system prompt, tools or document)
    RESTORE  an entry of the prompt cache (runner.cache.promptcache), or of its disk tier
    NONE     nothing shared: prefill from the start

A disk entry is read before it is placed: the sequence leaves the queue while a helper
thread reads it (runner.cache.diskread) and comes back to the front with the bytes, or
without them (a corrupt entry, a read past its deadline: then it goes as if the tier had
not had it); the other sequences are placed and decode meanwhile.

A copy costs something, so BRANCH and RESTORE must beat REUSE by MIN_GAIN tokens. A new
sequence whose prefix a prefilling slot is about to compute is HELD until it has, then
branches from it: sixteen requests sharing an agent's system prompt prefill it once,
which also covers the first burst at an idle model while its context grows. It reads
slots and the caches and returns decisions; schedule (runner.engine.schedule) turns
them into the step's KV ops, and run (runner.engine.run) makes the native calls.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence as Seq

from corral.errors import CorralError
from corral.runner.engine.admission import align_prefix, fit_prompt
from corral.runner.cache.caches import PrefixCaches
from corral.runner.cache.diskread import DiskReads, Fetched
from corral.runner.cache.promptcache import Entry
from corral.runner.prefix import Checkpoints, Cuts, KVBytes, common_prefix
from corral.runner.slots.sequence import SeqState
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.cache.diskcache import DiskEntry
    from corral.runner.engine.kvpool import KVPool
    from corral.runner.slots.sequence import Sequence

# Tokens a copy must save over reusing the slot's own cache. A copy's bytes cost far
# less than a token's prefill; what it pays is a fixed part (the state's parse, a
# find_slot, the target's own cache written out first), a few tokens' worth on a GPU.
# At 32, a short prompt sent again (33 tokens: 32 restorable, one read) never came
# back from RAM, where llama-server's cache brings it back whenever it keeps more.
MIN_GAIN = 8
HOLD_MIN = 64  # tokens a prefilling slot must be about to compute for a sequence to wait on it
# Where a window cache's sequences branch, a few tokens before their shared prefix ends
# (as llama-server checkpoints four tokens before a prompt's end): a copied state is cut
# back only as far as it was copied at (Cuts.recent), and the next burst over the same
# prefix often parts a token or two sooner ("Task a1", "Task b1"). Each branch reads
# these tokens again.
BRANCH_MARGIN = 8


class Source(enum.Enum):
    NONE = "none"
    REUSE = "reuse"
    BRANCH = "branch"
    RESTORE = "restore"


@dataclass(frozen=True)
class Placement:
    """A decision: `seq` runs on `slot`, whose first `n_prefix` tokens of `tokens` come from
    `source` (the donor slot, or the cache entry) and the rest are prefilled."""

    seq: "Sequence"
    slot: Slot
    tokens: list[int]
    n_prefix: int
    source: Source
    donor: Slot | None = None
    entry: Entry | None = None
    disk: "DiskEntry | None" = None
    data: bytes | None = None  # the disk entry's state, read and verified (runner.cache.diskread)
    # REUSE of fewer of the slot's tokens than it holds, on a memory that cannot be cut
    # there (Cuts): the slot's checkpoint at n_prefix, gone back to (runner.engine.plan
    # Rewind); RESTORE the same way, with the entry's
    checkpoint: bytes | bytearray | None = None
    checkpoints: Checkpoints = ()  # the disk entry's, read with its state (RAM keeps them)


@dataclass(frozen=True)
class Refusal:
    """A sequence that cannot run at all (its prompt does not fit): it fails alone."""

    seq: "Sequence"
    error: CorralError


class Placer:
    def __init__(self, num_ctx: int, caches: PrefixCaches, pool: "KVPool | None" = None,
                 reads: DiskReads | None = None, cuts: Cuts = Cuts()) -> None:
        """`reads` reads the disk tier for it; without them it looks only in RAM.
        `cuts`: where the memory can be cut back (a recurrent one, or a window cache
        past its window, keeps fewer of a state's tokens only back at a checkpoint)."""
        self.num_ctx, self.caches, self.pool, self.reads = num_ctx, caches, pool, reads
        self.cuts = cuts
        # Where a prefilling slot's prefill stops for sequences held for its prefix, on
        # a memory that could not be cut there after (Schedule._stops): seq id -> tokens
        self.holds: dict[int, int] = {}
        self.waiting: deque["Sequence"] = deque()  # new and preempted, oldest first
        self._fetched: dict[int, Fetched] = {}  # id(seq) -> its finished disk read

    def queued(self) -> int:
        """Sequences not yet placed: waiting, or waiting for a disk read."""
        return len(self.waiting) + (len(self.reads) if self.reads is not None else 0)

    def take_all(self) -> list["Sequence"]:
        """Every sequence not yet placed, taken off the queue (the engine is stopping)."""
        seqs = list(self.waiting) + (self.reads.abandon() if self.reads is not None else [])
        self.waiting.clear()
        self._fetched.clear()
        return seqs

    def add(self, seq: "Sequence") -> None:
        self.waiting.append(seq)

    def requeue(self, seq: "Sequence") -> None:
        """A preempted sequence goes back to the front: it is the oldest."""
        self.waiting.appendleft(seq)

    def next(self, slots: list[Slot]) -> Placement | Refusal | None:
        """The next sequence to admit, in order, skipping those held for a prefix being
        computed or read from disk; None when nothing can start now."""
        self._collect()
        self.holds = {}
        idle = [s for s in slots if s.state is SlotState.IDLE]
        for seq in list(self.waiting):
            if not idle:
                return None
            if seq.job.cancelled.is_set():
                continue  # schedule ends it (runner.engine.schedule)
            if self.pool is not None and not self.pool.admits(slots, self._need(seq)):
                return None  # no room in the pool yet: it and everything behind it wait
            resuming = seq.state is SeqState.PREEMPTED
            try:
                tokens = fit_prompt(seq.job, seq.generated if resuming else [], self.num_ctx)
            except CorralError as exc:  # ContextOverflow: this request's 400 alone
                self.waiting.remove(seq)
                self._fetched.pop(id(seq), None)
                return Refusal(seq, exc)
            placement = self._place(seq, tokens, idle, slots)
            if placement is None:
                continue
            self.waiting.remove(seq)
            if placement.disk is not None and placement.data is None:
                assert self.reads is not None
                self.reads.start(seq, placement.disk)  # back with the bytes, or without
                continue
            self._fetched.pop(id(seq), None)
            return placement
        return None

    def _collect(self) -> None:
        """Sequences whose disk read is over go back to the front of the queue, oldest
        first; what finished sequences were given is dropped."""
        if self.reads is None:
            return
        done = self.reads.poll()
        for fetched in done:
            self._fetched[id(fetched.seq)] = fetched
        self.waiting.extendleft(reversed([f.seq for f in done]))
        for key, fetched in list(self._fetched.items()):
            if fetched.seq.state is SeqState.FINISHED:  # reaped, or failed, while waiting
                del self._fetched[key]

    def _need(self, seq: "Sequence") -> int:
        return min(len(seq.job.prompt) + len(seq.generated), self.num_ctx)

    def _place(self, seq: "Sequence", tokens: list[int], idle: list[Slot],
               slots: list[Slot]) -> Placement | None:
        # At least one prompt token must be decoded to get logits; a prefix may not end
        # inside an image whose tokens attend both ways.
        def usable(n: int) -> int:
            return align_prefix(seq.job.images, min(n, len(tokens) - 1))

        # The idle slot that keeps the longest prefix, as its memory can be cut (a window
        # cache's slot whose state was copied in is cut back only at a checkpoint, where
        # another with the same prefix may be cut anywhere in its window); ties go to the
        # least recently used.
        shifted = seq.job.reuse_chunk > 0
        reuse, back, _, slot = max(
            ((*self._back(s.reusable(shifted), s.checkpoints,
                          usable(common_prefix(s.reusable(shifted), tokens)),
                          live=s.window_from), -s.last_used, s) for s in idle),
            key=lambda c: (c[0], c[2]))
        best = Placement(seq, slot, tokens, reuse, Source.REUSE if reuse else Source.NONE,
                         checkpoint=back)
        busy = [s for s in slots if s.state is not SlotState.IDLE and not s.tainted]
        # The slot a copy goes to: the one whose own cache is worth least.
        target = min(idle, key=lambda s: (len(s.reusable()), s.last_used))
        for donor in busy:  # its state whole, as it is: no checkpoint of it goes across
            n = self._restorable(donor.cached, (), usable(common_prefix(donor.cached, tokens)))
            if n >= best.n_prefix + MIN_GAIN:
                best = Placement(seq, target, tokens, n, Source.BRANCH, donor=donor)
        best = self._from_cache(seq, tokens, target, best, usable)
        if seq.state is SeqState.WAITING and self._worth_holding(tokens, busy, best.n_prefix):
            return None
        return best

    def _from_cache(self, seq: "Sequence", tokens: list[int], target: Slot, best: Placement,
                    usable: Callable[[int], int]) -> Placement:
        """`best`, or a restore into `target` from the prompt cache where that keeps at
        least MIN_GAIN tokens more: from RAM, or from disk, read once per sequence (its
        read is done, bytes or not, or starts now)."""
        read = self._fetched.get(id(seq))
        hit = self.caches.lookup(tokens, disk=read is None and self.reads is not None
                                 and self.reads.open)
        if hit.entry is not None or hit.disk is not None:
            if hit.entry is not None:
                n, back = self._back(hit.entry.tokens, hit.entry.checkpoints, usable(hit.n))
            else:  # a disk entry's checkpoints come with its read: where they are, now
                assert hit.disk is not None
                n, back = self._restorable(hit.disk.tokens, hit.disk.marks, usable(hit.n)), None
            if n >= best.n_prefix + MIN_GAIN:
                best = Placement(seq, target, tokens, n, Source.RESTORE, entry=hit.entry,
                                 disk=hit.disk, checkpoint=back)
        if read is not None and read.data is not None:
            held = read.entry.tokens
            n, back = self._back(held, read.checkpoints, usable(common_prefix(held, tokens)))
            if n >= best.n_prefix + MIN_GAIN:
                best = Placement(seq, target, tokens, n, Source.RESTORE, disk=read.entry,
                                 data=read.data, checkpoints=read.checkpoints,
                                 checkpoint=back)
        return best

    def _restorable(self, held: Seq[int], marks: Seq[int], n: int,
                    live: int | None = None) -> int:
        """How much of a state holding `held` (a slot's, a cache entry's) a placement
        keeps: all `n` of it where the memory can be cut anywhere (Cuts), or, in a
        slot's `live` sequence (whole from its Slot.window_from), where a window cache
        likely still holds the window before `n` (a failed check reads the whole
        prompt); else the whole state, or its latest checkpoint (`marks`) within `n`,
        else nothing. A copied state (the cache, another slot) holds only its own end's
        window."""
        if self._as_is(len(held), n, live):
            return n
        return max((m for m in marks if m <= n), default=0)

    def _as_is(self, held: int, n: int, live: int | None) -> bool:
        """Whether a state of `held` tokens is cut to `n` without a checkpoint."""
        return n >= held or self.cuts.anywhere(held) or (
            live is not None and self.cuts.recent(held, n, live))

    def _back(self, held: Seq[int], checkpoints: Seq[tuple[int, KVBytes]], n: int,
              live: int | None = None) -> tuple[int, KVBytes | None]:
        """`_restorable` of a state with its `checkpoints`, and the one it goes back to
        for that (None: nothing is cut, or a cut the memory makes there)."""
        kept = self._restorable(held, [m for m, _ in checkpoints], n, live)
        return kept, None if self._as_is(len(held), kept, live) else dict(checkpoints).get(kept)

    def _worth_holding(self, tokens: list[int], busy: list[Slot], have: int) -> bool:
        """Whether a prefilling slot is about to compute at least HOLD_MIN more of this
        prompt's prefix than is at hand now. Where the slot's memory could not be cut
        back there once it has gone past, its prefill stops there (`holds`), so that the
        held sequence branches from it whole."""
        for slot in busy:
            if slot.state is not SlotState.PREFILL:
                continue
            # a branch leaves at least one token to decode
            ahead = min(common_prefix(slot.cached + slot.pending, tokens), len(tokens) - 1)
            if self.cuts.below:
                ahead -= BRANCH_MARGIN
            if ahead > len(slot.cached) and ahead >= have + HOLD_MIN:
                if not self.cuts.anywhere(ahead) and slot.job is not None \
                        and not slot.job.images:
                    self.holds[slot.seq_id] = min(self.holds.get(slot.seq_id, ahead), ahead)
                return True
        return False
