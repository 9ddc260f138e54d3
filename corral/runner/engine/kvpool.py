"""Cell accounting for slots that share one KV buffer.

By default the buffer holds every slot's num_ctx, so every admitted sequence has its
whole context and nothing below is ever short of cells but a step that a parked infill
run crowds. In pool mode (CORRAL_KV_POOL=on) the buffer is smaller, num_ctx only caps a
sequence, and so more sequences run than reservations would allow. The price is that
the pool can fill while they generate: then the newest sequence is preempted (its
cells freed, its job back at the front of the queue with its progress) and recomputed
once there is room. Pure: it reads slot state and decides; schedule
(runner.engine.schedule) turns its decisions into the step's ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from corral.runner.slots.slot import Slot, SlotState

RESERVE = 32  # cells a new request must find beyond its prompt, so it can start generating


class Relief(NamedTuple):
    """A slot whose cells go for room: an idle one's cache, or a running sequence (preempt)."""

    slot: Slot
    preempt: bool


@dataclass
class KVPool:
    size: int  # cells (tokens, all sequences together)
    reserve: int = RESERVE
    preemptions: int = 0
    # Set by a preemption, cleared when a sequence ends: until then nothing new is
    # admitted, or the job just preempted would come straight back, be preempted
    # again at the next step, and recompute its tokens over and over.
    pressure: bool = False

    @staticmethod
    def used(slots: Iterable[Slot], parked: int = 0) -> int:
        """Cells holding KV now: idle slots' cached prefixes included, and `parked`, the
        cells of a run parked on the scratch sequence (runner.engine.parking)."""
        return sum(s.n_past for s in slots) + parked

    @staticmethod
    def committed(slots: Iterable[Slot]) -> int:
        """Cells running requests hold or are about to fill with their prompts."""
        return sum(s.n_past + len(s.pending) for s in slots if s.state is not SlotState.IDLE)

    def admits(self, slots: list[Slot], n_prompt: int) -> bool:
        """Whether a request with this many prompt tokens may start now (idle caches
        are evicted for it). An empty pool admits anything that fits at all."""
        committed = self.committed(slots)
        if self.pressure and committed:
            return False
        return committed + min(n_prompt + self.reserve, self.size) <= self.size

    def shortfall(self, slots: list[Slot], growth: int, parked: int = 0) -> int:
        """Cells missing for a step that adds `growth` tokens; <= 0 when it fits."""
        return self.used(slots, parked) + growth - self.size

    @staticmethod
    def evictable(slots: list[Slot]) -> list[Slot]:
        """Idle slots holding cached prefixes, least recently used first."""
        return sorted((s for s in slots if s.state is SlotState.IDLE and s.cached),
                      key=lambda s: s.last_used)

    @staticmethod
    def victim(slots: list[Slot]) -> Slot | None:
        """The newest running sequence: it has the least work to lose, and the oldest
        requests keep going (admission is oldest first too)."""
        busy = [s for s in slots if s.state is not SlotState.IDLE]
        if len(busy) <= 1:
            return None  # one sequence alone always fits: num_ctx <= the pool
        return max(busy, key=lambda s: (s.t_start, s.seq_id))

    def relief(self, slots: list[Slot], growth: int, parked: int = 0) -> Relief | None:
        """What goes next so that a step adding `growth` cells fits: an idle cache first
        (least recently used), then the newest running sequence; None when it fits, or
        nothing more can go. The caller frees it, then asks again."""
        if self.shortfall(slots, growth, parked) <= 0:
            return None
        idle = KVPool.evictable(slots)
        if idle:
            return Relief(idle[0], preempt=False)
        victim = KVPool.victim(slots)
        return Relief(victim, preempt=True) if victim is not None else None
