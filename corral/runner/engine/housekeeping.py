"""What the engine does between steps: it gives back memory, so that it returns to what
`ps` reports, when idle and every few seconds under load, when the engine may never be
idle; and at rest, once a step's answer is out (QUIET), it decodes the prompt tokens
that slots owe, then copies the idle slot a new conversation would take into the prompt
cache, ahead of the placement that would copy it on a first token's time.

The engine thread calls `rest` before it waits for work; everything here runs on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from corral.runner.llama import native
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.kv.growth import Resizer
    from corral.runner.kv.settle import Settler
    from corral.runner.llama.embedding import EmbeddingContext
    from corral.runner.watch import StepWatch

# An idle embedding context is freed after this long: a burst of embed calls
# reuses it, and a daemon that embeds once does not keep its buffers for good.
EMBED_KEEP = 10.0
TRIM_EVERY = 5.0  # seconds between heap trims while busy (one costs about a millisecond)
# What rest does that no request waits for (a prompt token a slot owes, a presave, a
# heap trim) waits this long after the last step, unless work arrives first: a step's
# answer is still on its way out then (the runner's stream, the daemon's response: 3-8
# ms on two cores), and a decode on every core beside it would delay it.
QUIET = 0.05


class Housekeeping:
    def __init__(self, embed_ctx: EmbeddingContext, resizer: Resizer | None,
                 settler: Settler | None, watch: StepWatch,
                 queued: Callable[[], int] = lambda: 0,
                 redo: Callable[[list[Slot]], None] = lambda slots: None,
                 presave: Callable[[list[Slot]], None] = lambda slots: None) -> None:
        """`queued`: requests not yet placed (waiting for a disk read, or still in the
        inbox), which a settle would delay; asked only when one is due. `redo`: decodes
        the tokens idle slots owe (runner.engine.run Run.redo). `presave`: copies the idle
        slot a new conversation would take into the prompt cache once a step's answer is
        out (Run.presave)."""
        self.embed_ctx, self.resizer, self.settler, self.watch = \
            embed_ctx, resizer, settler, watch
        self.queued, self.redo, self.presave = queued, redo, presave
        self.presaved = -1  # the engine's decode steps at the last presave
        self.embedded_at = self.trimmed_at = self.worked_at = 0.0
        self.steps = 0  # the engine's decode steps when last here
        self.transient = False  # freed native memory waits to be handed back when idle
        self.owing = False  # a slot owes a prompt token (runner.slots.slot Owed)

    def wait(self, now: float) -> float:
        """How long the idle engine may wait for work before rest has more to do (a
        presave waits while a request is queued: a disk read's end wakes the engine)."""
        if self.owing or self.transient or (self.presaved != self.steps
                                            and not self.queued()):
            return min(0.5, max(0.0, self.worked_at + QUIET - now))
        return 0.5

    def freed(self, now: float | None = None) -> None:
        """Native memory was freed (`now`: by an embedding, whose context is kept a while)."""
        self.transient = True
        if now is not None:
            self.embedded_at = now

    def rest(self, idle: bool, now: float, slots: list[Slot], sampled: bool,
             save: Callable[[Slot], None], steps: int) -> None:
        """`steps`: the engine's decode steps so far (a request placed, decoded and ended
        within one step never shows as busy here)."""
        if steps != self.steps:
            self.worked_at = now
        quiet = idle and now - self.worked_at >= QUIET
        # A prompt's last token, taken back from a sequence that ended in the step that
        # read it, goes back in once the answer is out (QUIET): the slot then holds the
        # whole prompt, and so does what a settle or the next conversation saves of it
        # (runner.slots.slot Owed). Before a request that came meanwhile too (one decoded
        # row): what a slot holds at the next placement so depends on the requests
        # placed, not on when one arrived.
        self.owing = any(slot.owed is not None for slot in slots) and all(
            slot.state is SlotState.IDLE for slot in slots)
        if self.owing and (quiet or not idle or self.queued()):
            self.owing = False
            self._watched("a prompt's last token decoded again", lambda: self.redo(slots))
        if quiet and self.presaved != steps and not self.queued():  # after the redo
            self.presaved = steps
            self._watched("an idle slot copied to the prompt cache",
                          lambda: self.presave(slots))
        # runner.kv.reserve: made on a builder thread after the first rest.
        if idle and self.resizer is not None:
            self.resizer.rest(sampled)
        if self.settler is not None:
            if not idle or steps != self.steps:
                self.settler.busy(now)
            elif self.settler.due(now) and not self.queued():  # pages back (runner.kv.settle)
                settler = self.settler
                if self._watched("a settle of the shared KV",
                                 lambda: settler.settle(slots, save)):
                    self.transient = True
        if idle and self.embed_ctx.ctx is not None and now - self.embedded_at > EMBED_KEEP:
            self.embed_ctx.free()
            self.transient = True
        if self.transient and (quiet or now - self.trimmed_at > TRIM_EVERY):
            native.release_free_memory()
            self.transient, self.trimmed_at = False, now
        self.steps = steps

    def _watched(self, what: str, work: Callable[[], object]) -> object:
        """Native work at rest, under the stall watch (no step's grace: `worked` False)."""
        self.watch.enter(what)
        try:
            return work()
        finally:
            self.watch.leave(worked=False)
