"""The scratch sequence and the one infill run parked on it: one owner, one record.

Text typed before an infill's cached suffix would shift the suffix's cells; instead they
go to the scratch sequence (a Park, runner.engine.kvplan.reuse_moves) while the typed
tokens decode, and join the slot's KV again once its prompt reaches them (a Join). One
run waits there at a time. The run belongs to the sequence that parked it: once that
sequence leaves the slot (it ended, failed, was refused a sampler, lost its decode or
was preempted) the run goes with a Drop, and the engine is not at rest while one
waits to go (runner.engine.engine). Schedule owns this record and is the only writer;
the batch planner stops the slot's rows at the join, and the pool counts the cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.runner.engine.plan import Drop, Join, KVOp, Park
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot


@dataclass(frozen=True)
class ParkedRun:
    slot: Slot
    seq: Sequence  # its owner: the run lives while this sequence holds the slot
    join_at: int  # the slot's position where the run's cells go back
    cells: int
    new: bool  # its sequence was placed for the first time (its prompt count takes the run)


class Parking:
    def __init__(self, scratch: int | None) -> None:
        self.scratch = scratch  # the context's scratch sequence id (None: per-slot streams)
        self.run: ParkedRun | None = None

    def free(self) -> int | None:
        """The scratch sequence, if a placement may park a run there now."""
        return self.scratch if self.run is None else None

    @property
    def cells(self) -> int:
        return self.run.cells if self.run is not None else 0

    def joins(self) -> dict[int, int]:
        """Slot seq id -> the position its prefill stops at (the run joins there)."""
        run = self.run
        return {run.slot.seq_id: run.join_at} if run is not None and self._owned() else {}

    def park(self, slot: Slot, op: Park, new: bool) -> None:
        assert self.run is None and slot.sequence is not None
        self.run = ParkedRun(slot, slot.sequence, op.dst, op.n, new)

    def pending(self) -> bool:
        """A run whose owner has gone: its Drop is still to be planned."""
        return self.run is not None and not self._owned()

    def settle(self) -> list[KVOp]:
        """The run's ops now: a Join once the typed tokens before it are in the KV (its
        cached tokens and its sequence's evaluated count take the run in); a Drop once
        its sequence left the slot; none while the typed tokens still decode."""
        run = self.run
        if run is None or self.scratch is None:
            return []
        if not self._owned():
            self.run = None
            return [Drop(self.scratch)]
        slot, seq = run.slot, run.seq
        if slot.n_past != run.join_at:
            return []
        slot.cached.extend(seq.pending[:run.cells])
        del seq.pending[:run.cells]
        if run.new:  # a resumed sequence's count is its first placement's
            seq.n_prompt_eval -= run.cells
        self.run = None
        return [Join(slot.seq_id, self.scratch, run.join_at, run.cells)]

    def moved(self, scratch: int | None) -> None:
        """A new context (runner.kv.growth) took the slots' cells but not the scratch
        sequence's: a parked run is evaluated with the prompt instead (its tokens are
        still pending)."""
        self.scratch, self.run = scratch, None

    def _owned(self) -> bool:
        run = self.run
        return run is not None and run.slot.sequence is run.seq
