"""The native side of what a step does to sequences' KV cells, beside decoding into them:
each op schedule planned (runner.engine.plan, decided in runner.engine.kvplan) done on the
context, and recovery after a failed decode. Only run (runner.engine.run) calls these."""

from __future__ import annotations

from typing import Any, Callable

import llama_cpp as L

from corral.runner.cache.caches import PrefixCaches
from corral.runner.engine.admission import align_prefix
from corral.runner.engine.plan import (Branch, Drop, Join, KVOp, Mark, Move, Park, Restore,
                                       Rewind, Save, Shift, Trim)
from corral.runner.kv import kvbytes
from corral.runner.prefix import Cuts, KVBytes
from corral.runner.slots.slot import Slot, SlotState


class KVOps:
    """One step's ops on a context, in the plan's order. `failed` gathers the sequences
    whose prefix could not be put in place; `donors` keeps the states read from donor
    sequences within the step (no decode runs between the ops, so a donor's KV changes
    only by an op on it, which forgets its state): fifteen requests branching from one
    slot read it once."""

    def __init__(self, ctx: Any, mem: Any, caches: PrefixCaches, streams: int,
                 cuts: Cuts = Cuts(), whole: Callable[[int, int], bool] | None = None
                 ) -> None:
        """`cuts`: where the memory takes a partial removal, and how many checkpoints a
        slot keeps (runner.llama.context); `whole`: whether a window cache's sequence
        cut to a length still holds the window before it."""
        self.ctx, self.mem, self.caches, self.streams = ctx, mem, caches, streams
        self.cuts, self.whole = cuts, whole
        self.failed: set[int] = set()
        self._donors: dict[int, KVBytes] = {}

    def run(self, op: KVOp) -> None:
        if isinstance(op, Save):  # reads the cells before a later op overwrites them
            self._save(op)
            return
        if isinstance(op, Mark):  # reads only: a donor's state read this step still holds
            # (a slot preempted after its mark was planned holds nothing to read)
            data = kvbytes.get_partial(self.ctx, op.seq_id) if op.slot.n_past else None
            if data is not None:
                op.slot.checkpoints = (op.slot.checkpoints + [(op.slot.n_past, data)])[
                    -self.cuts.checkpoints:]
            return
        self._donors.pop(op.seq_id, None)
        mem, seq = self.mem, op.seq_id
        if isinstance(op, Drop):
            L.llama_memory_seq_rm(mem, seq, -1, -1)
        elif isinstance(op, Trim):
            # A partial removal fails on memories that cannot roll back (recurrent models).
            # With snapshots for drafts (n_rs_seq) llama.cpp would take back any of the
            # last few positions, from states only a draft's ubatch wrote, and a window
            # cache would keep cells that miss KV it overwrote: past a draft, only a cut
            # such a memory can make is asked of it.
            if not (L.llama_memory_seq_rm(mem, seq, op.n_prefix, -1) if op.draft
                    else self._trim(seq, op.n_prefix)):
                self._fail(seq)
        elif isinstance(op, Rewind):  # the state first: the cut then leaves it alone
            if not (kvbytes.put_partial(self.ctx, op.data, seq)
                    and L.llama_memory_seq_rm(mem, seq, op.n_prefix, -1)):
                self._fail(seq)
        elif isinstance(op, Move):
            L.llama_memory_seq_rm(mem, seq, op.dst, op.src)
            L.llama_memory_seq_add(mem, seq, op.src, op.src + op.n, op.dst - op.src)
        elif isinstance(op, Park):  # a cell's position is the cell's: it leaves seq first
            L.llama_memory_seq_rm(mem, op.scratch, -1, -1)
            L.llama_memory_seq_cp(mem, seq, op.scratch, op.src, op.src + op.n)
            L.llama_memory_seq_rm(mem, seq, op.keep, -1)
            L.llama_memory_seq_add(mem, op.scratch, op.src, op.src + op.n, op.dst - op.src)
        elif isinstance(op, Join):
            L.llama_memory_seq_cp(mem, op.scratch, seq, op.at, op.at + op.n)
            L.llama_memory_seq_rm(mem, op.scratch, -1, -1)
        elif isinstance(op, Shift):
            keep, discard = op.keep, op.discard
            L.llama_memory_seq_rm(mem, seq, keep, keep + discard)
            L.llama_memory_seq_add(mem, seq, keep + discard, op.n_past, -discard)
        else:
            self._fill(op)

    def _save(self, op: Save) -> None:
        # Asked again here: a save or restore earlier in this step may hold the tokens now.
        if self.caches.wanted(op.tokens):
            data = kvbytes.get(self.ctx, op.seq_id)
            if data is not None:
                self.caches.save(op.tokens, data, op.checkpoints)

    def _fill(self, op: Restore | Branch) -> None:
        """A prefix copied in: from the prompt cache, or from a donor sequence (which must
        not have failed itself this step)."""
        mem, seq = self.mem, op.seq_id
        if isinstance(op, Branch):
            data = None if op.donor in self.failed else self._donor_state(op.donor)
        else:
            data = op.data
        L.llama_memory_seq_rm(mem, seq, -1, -1)
        if data is not None and kvbytes.put(self.ctx, data, seq, self.streams) \
                and self._cut_to(op) and L.llama_memory_seq_rm(mem, seq, op.cut, -1):
            if isinstance(op, Branch):
                self.caches.tokens_shared += op.n_prefix
            else:
                self.caches.restored(op.entry, op.disk, op.n_prefix, data, op.checkpoints)
            return
        self._fail(seq)
        self.caches.refused(op.entry if isinstance(op, Restore) else None)

    def _cut_to(self, op: Restore | Branch) -> bool:
        """Whether a filled sequence may be cut where the op says: back at a checkpoint
        of the entry (put back first, where the placer chose one: the memory cannot be
        cut there otherwise), else as `_cuts` says."""
        checkpoint = op.checkpoint if isinstance(op, Restore) else None
        if checkpoint is not None:
            return kvbytes.put_partial(self.ctx, checkpoint, op.seq_id)
        return self._cuts(op.seq_id, op.cut)

    def _trim(self, seq: int, n: int) -> bool:
        """A cut the placer planned: where the memory makes it (`_cuts`), or within a
        window of the end of a window cache's sequence, checked after: its ring may
        have come round to the KV the next token needs."""
        if self._cuts(seq, n):
            return bool(L.llama_memory_seq_rm(self.mem, seq, n, -1))
        held = L.llama_memory_seq_pos_max(self.mem, seq) + 1
        return self.cuts.recent(held, n) and self.whole is not None \
            and L.llama_memory_seq_rm(self.mem, seq, n, -1) and self.whole(seq, n)

    def _cuts(self, seq: int, at: int) -> bool:
        """Whether the sequence may be cut at `at`: anywhere while its memory can be cut
        anywhere (Cuts, by the tokens it holds), else only where nothing goes (llama.cpp's
        snapshots of the last ubatch would take a few positions back from states no
        draft of this sequence wrote)."""
        last = L.llama_memory_seq_pos_max(self.mem, seq)
        return self.cuts.anywhere(last + 1) or at > last

    def _fail(self, seq: int) -> None:
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.failed.add(seq)

    def _donor_state(self, donor: int) -> KVBytes | None:
        if donor not in self._donors:
            data = kvbytes.get(self.ctx, donor)
            if data is None:
                return None
            self._donors[donor] = data
        return self._donors[donor]


def drop(mem: Any, slot: Slot) -> None:
    """Free every cell of the slot's sequence; it caches nothing after."""
    L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    slot.cached, slot.checkpoints = [], []


def _rewind(slot: Slot) -> None:
    """A slot stopped inside an image that must be decoded whole (an M-RoPE image's
    tokens share one position, which no cut can split) goes back to its start: the
    slices it holds become pending again, and the retry decodes the image from there."""
    if slot.job is None:
        return
    keep = align_prefix(slot.job.images, slot.n_past)
    if keep < slot.n_past:
        slot.pending[:0] = slot.cached[keep:]
        del slot.cached[keep:]
        slot.keep_checkpoints(keep)


def recover(mem: Any, rc: int, failed: list[Slot], slots: list[Slot]) -> bool:
    """After a failed decode: True when dropping idle slots' cached prefixes made room
    (rc 1: no KV cells) and the failed slots retry next step from where they were.
    Else their sequences are dropped and the caller fails their jobs."""
    evicted = False
    if rc == 1:
        for slot in slots:
            if slot.state is SlotState.IDLE and slot.cached:
                drop(mem, slot)
                evicted = True
    for slot in failed:
        if evicted:
            _rewind(slot)
            L.llama_memory_seq_rm(mem, slot.seq_id, slot.pos(slot.n_past), -1)
        else:
            drop(mem, slot)
    return evicted
