"""A shared KV buffer gives back the pages a burst wrote once the model rests.

In one shared buffer (the default layout: runner.process.loading.layout) a page of KV
is committed the first time a cell on it is written, and stays committed after the
cell is freed: after a burst the buffer holds the burst's high-water mark. Elastic
streams give that back by moving to a smaller context (runner.kv.growth); a shared
buffer is already the cap's size and has nowhere to move, so it settles in place,
with the same rule and the same result as a shrink to one stream: after SHRINK_AFTER
with nothing running, the most recently used idle cache is read out
(llama_state_seq_get_data), the other caches go to the prompt cache as a shrink
leaves them, the buffer is cleared (install.sh's ggml hands every page back), and the
cache kept is written back into the first cells. Bit-exact KV, so a conversation that
returns finds its prefix as it left it.

    ACTIVE --nothing runs for SHRINK_AFTER--> settle --> SETTLED --a request runs--> ACTIVE

A settle is skipped (SETTLED at once) where the pages committed are within SLACK of
what the kept cache needs: nothing worth the copy would come back.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Callable

import llama_cpp as L

from corral.runner.kv import kvbytes
from corral.runner.kv.growth import SHRINK_AFTER
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.llama.context import LlamaContext

log = logging.getLogger("corral.settle")

SLACK = 16 << 20  # bytes committed beyond the kept cache's before a settle is worth it


class SettleState(enum.Enum):
    ACTIVE = "active"  # cells were written since the last settle
    SETTLED = "settled"  # the pages committed are what the kept cache needs


class Settler:
    """The one owner of a shared buffer's settling: when it is due, and the settle."""

    def __init__(self, llama: LlamaContext, shrink_after: float = SHRINK_AFTER) -> None:
        self.llama, self.shrink_after = llama, shrink_after
        self.state = SettleState.SETTLED  # a new buffer has written nothing
        self.busy_at = 0.0
        self.settles = 0

    def busy(self, now: float) -> None:
        """Something runs: the buffer may be writing pages."""
        self.state, self.busy_at = SettleState.ACTIVE, now

    def due(self, now: float) -> bool:
        return self.state is SettleState.ACTIVE and now - self.busy_at >= self.shrink_after

    def settle(self, slots: list[Slot], save: Callable[[Slot], None]) -> bool:
        """ACTIVE -> SETTLED: every slot is idle (the engine's caller checks). Whether the
        buffer was cleared; a cache that cannot be written back is dropped (the slot
        then holds nothing), never left half there. SETTLED once it is done."""
        try:
            return self._settle(slots, save)
        finally:
            self.state = SettleState.SETTLED

    def _settle(self, slots: list[Slot], save: Callable[[Slot], None]) -> bool:
        committed, size = self.llama.kv_committed(), self.llama.kv_size()
        if committed is None or not size:
            return False  # stock ggml: the clear would write every page, nothing comes back
        cached = sorted((s for s in slots if s.state is SlotState.IDLE and s.cached),
                        key=lambda s: -s.last_used)
        keep = cached[0] if cached else None
        need = size * (keep.n_past if keep is not None else 0) // max(self.llama.n_ctx, 1)
        if committed <= need + SLACK:
            return False
        for slot in cached[1:]:
            save(slot)  # into the prompt cache, if worth it (runner.engine.kvplan.save_op)
            slot.cached, slot.tainted = [], False
        state = kvbytes.get(self.llama.ctx, keep.seq_id) if keep is not None else None
        L.llama_memory_clear(self.llama.mem, True)
        if keep is not None and (state is None or not kvbytes.put(
                self.llama.ctx, state, keep.seq_id, 1)):
            L.llama_memory_seq_rm(self.llama.mem, keep.seq_id, -1, -1)
            keep.cached, keep.tainted = [], False
        elif keep is not None:  # llama.cpp copied only the cells its end's window sees
            keep.window_from = max(keep.n_past - (self.llama.window or 0), 0)
        self.settles += 1
        log.info("settled the shared KV: %d MiB committed, %d MiB kept", committed >> 20,
                 (self.llama.kv_committed() or 0) >> 20)
        return True
