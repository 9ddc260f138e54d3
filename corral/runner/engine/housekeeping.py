"""What the engine gives back between steps, so memory returns to what `ps` reports:
when idle, and every few seconds under load, when the engine may never be idle.

The engine thread calls `rest` before it waits for work; everything here runs on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from corral.runner.llama import native
from corral.runner.slots.slot import Slot

if TYPE_CHECKING:
    from corral.runner.kv.growth import Resizer
    from corral.runner.kv.settle import Settler
    from corral.runner.llama.embedding import EmbeddingContext
    from corral.runner.watch import StepWatch

# An idle embedding context is freed after this long: a burst of embed calls
# reuses it, and a daemon that embeds once does not keep its buffers for good.
EMBED_KEEP = 10.0
TRIM_EVERY = 5.0  # seconds between heap trims while busy (one costs about a millisecond)


class Housekeeping:
    def __init__(self, embed_ctx: EmbeddingContext, resizer: Resizer | None,
                 settler: Settler | None, watch: StepWatch,
                 queued: Callable[[], int] = lambda: 0) -> None:
        """`queued`: requests not yet placed (waiting for a disk read, or still in the
        inbox), which a settle would delay; asked only when one is due."""
        self.embed_ctx, self.resizer, self.settler, self.watch = \
            embed_ctx, resizer, settler, watch
        self.queued = queued
        self.embedded_at = self.trimmed_at = 0.0
        self.steps = 0  # the engine's decode steps when last here
        self.transient = False  # freed native memory waits to be handed back when idle

    def freed(self, now: float | None = None) -> None:
        """Native memory was freed (`now`: by an embedding, whose context is kept a while)."""
        self.transient = True
        if now is not None:
            self.embedded_at = now

    def rest(self, idle: bool, now: float, slots: list[Slot], sampled: bool,
             save: Callable[[Slot], None], steps: int) -> None:
        """`steps`: the engine's decode steps so far (a request placed, decoded and ended
        within one step never shows as busy here)."""
        # runner.kv.reserve: made on a builder thread after the first rest.
        if idle and self.resizer is not None:
            self.resizer.rest(sampled)
        if self.settler is not None:
            if not idle or steps != self.steps:
                self.settler.busy(now)
            elif self.settler.due(now) and not self.queued():  # pages back (runner.kv.settle)
                self.watch.enter("a settle of the shared KV")
                try:
                    self.transient = self.settler.settle(slots, save) or self.transient
                finally:
                    self.watch.leave(worked=False)
        if idle and self.embed_ctx.ctx is not None and now - self.embedded_at > EMBED_KEEP:
            self.embed_ctx.free()
            self.transient = True
        if self.transient and (idle or now - self.trimmed_at > TRIM_EVERY):
            native.release_free_memory()
            self.transient, self.trimmed_at = False, now
        self.steps = steps
