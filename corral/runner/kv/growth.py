"""Elastic KV: a model holds one sequence's KV while idle and grows when requests run
at once; a state machine with every transition here, and the move between contexts.

    STEADY --demand above the streams--> BUILDING --built--> STEADY (more streams)
             (requests running or waiting, or warm conversations: see Capacity.warm)
    STEADY --quiet for SHRINK_AFTER----> BUILDING --built--> STEADY (fewer streams)
                                           \\--failed--> STEADY (the cap drops to now)

Why contexts are swapped rather than one sized for the cap: stock ggml clears a
context's whole KV buffer when it is made, writing every page (a second and 1.5 GB for
sixteen slots of a 135M model here), whether or not a second request ever comes; and
even where install.sh's ggml leaves them uncommitted (runner.kv.reserve), pages a burst
wrote stay committed until the context's cells are cleared, which only a move to
another context allows while idle conversations keep theirs. When requests run at once, the next context
is made on a builder thread while the current one goes on decoding; then, between
two steps, the engine copies every cached sequence across (runner.kv.kvbytes: bit-exact
KV, so greedy output is unchanged) and lets the old context go, freed on a thread of
its own; an idle slot's cache that a smaller context has no room for goes to the
prompt cache (runner.cache.promptcache). Nobody waits longer than that copy, except
the requests that needed the new streams, which wait for the build. Sizes are powers of two from
the start size to the memory-fit cap, so a burst of sixteen takes one step. Where
runner.kv.reserve has made the cap's context ahead (uncommitted), growth to the cap takes
it instead of building, and a shrink gives it back.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from corral.errors import RunnerError
from corral.runner.jobs import Command, Resized
from corral.runner.kv.kvbytes import copy_sequence
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.llama.context import LlamaContext
    from corral.runner.kv.reserve import Reserve

log = logging.getLogger("corral.growth")

SHRINK_AFTER = 30.0  # seconds at or below half the streams before giving half back
# An idle slot's prefix counts as a warm conversation when it holds at least this many
# tokens and was used within half the shrink window: two conversations that alternate
# then each keep a stream (no state copied out and back at every turn), and a model
# left alone is back to one stream within SHRINK_AFTER and a half.
WARM_MIN_TOKENS = 32


class GrowthState(enum.Enum):
    STEADY = "steady"
    BUILDING = "building"  # a context of `target` streams is being made off the engine thread


def tier(n: int, start: int, cap: int) -> int:
    """The size that holds n sequences: a power of two, within [start, cap]."""
    size = start
    while size < n and size < cap:
        size *= 2
    return min(size, cap)


@dataclass
class Capacity:
    start: int  # streams when idle
    cap: int  # most streams memory allows
    streams: int = 0  # streams now
    state: GrowthState = GrowthState.STEADY
    target: int = 0
    busy_at: float = 0.0  # last use above half the streams, on the caller's clock
    shrink_after: float = SHRINK_AFTER
    on_reserve: bool = False  # serving from runner.kv.reserve's context: unused cells cost no RAM

    def __post_init__(self) -> None:
        self.streams = self.streams or self.start

    def warm(self, cached: int, last_used: float, now: float) -> bool:
        """An idle slot's prefix that a conversation came back to lately: a stream worth
        keeping, as llama-server keeps one slot per conversation."""
        return cached >= WARM_MIN_TOKENS and now - last_used < self.shrink_after / 2

    def want(self, busy: int, waiting: int, now: float, warm: int = 0) -> int | None:
        """A size to build now, or None. Growth covers everything running and waiting,
        and the `warm` conversations (streams in use or used lately, and the warm prefix
        a placement just overwrote), so that conversations that alternate each keep their
        KV instead of evicting each other; shrinking waits until that demand has stayed
        at or below half the streams a while."""
        if self.state is GrowthState.BUILDING:
            return None
        demand = max(busy + waiting, warm)
        if demand > self.streams:
            return self._build(tier(demand, self.start, self.cap)) \
                if self.streams < self.cap else None
        # On the reserve, streams nobody uses cost nothing (their pages were handed back),
        # so it is kept while anything beyond the idle size is in use.
        in_use = demand > (self.start if self.on_reserve else self.streams // 2)
        if in_use or self.streams <= self.start:
            self.busy_at = now
            return None
        if now - self.busy_at >= self.shrink_after:
            return self._build(tier(max(demand, 1), self.start, self.cap))
        return None

    def _build(self, target: int) -> int:
        self.state, self.target = GrowthState.BUILDING, target
        return target

    def built(self, now: float) -> None:
        """BUILDING -> STEADY at the target size."""
        assert self.state is GrowthState.BUILDING
        self.state, self.streams, self.busy_at = GrowthState.STEADY, self.target, now

    def failed(self) -> None:
        """BUILDING -> STEADY unchanged: no growth past what it has (memory ran out)."""
        assert self.state is GrowthState.BUILDING
        self.state = GrowthState.STEADY
        if self.target > self.streams:
            self.cap = self.streams


def carry(slots: list[Slot], old: Any, new: Any, streams: int, num_ctx: int,
          save: Callable[[Slot], None] | None = None) -> list[Slot] | None:
    """The slots of a context of `streams` streams, with every running sequence and as
    many recently used caches as fit copied across; None when the running ones do not fit.
    The caches left behind go to `save` first (from the old context). Slot ids are
    renumbered in order: a sequence's KV moves to its new id."""
    busy = [s for s in slots if s.state is not SlotState.IDLE]
    idle = sorted((s for s in slots if s.state is SlotState.IDLE and s.cached),
                  key=lambda s: -s.last_used)
    if len(busy) > streams:
        return None
    if save is not None:
        for left in (busy + idle)[streams:]:
            save(left)
    out: list[Slot] = []
    for old_slot in (busy + idle)[:streams]:
        seq_id = len(out)
        cached = list(old_slot.cached)
        if cached and not copy_sequence(old, old_slot.seq_id, new, seq_id, streams):
            if old_slot.state is not SlotState.IDLE:
                return None  # a running sequence must move whole
            cached = []
        out.append(Slot(seq_id=seq_id, num_ctx=num_ctx, state=old_slot.state, cached=cached,
                        sequence=old_slot.sequence, last_used=old_slot.last_used,
                        tainted=old_slot.tainted))
    out += [Slot(seq_id=i, num_ctx=num_ctx) for i in range(len(out), streams)]
    return out


class Resizer:
    """The engine's side of elastic KV: asks the policy, builds off the engine thread,
    and moves the sequences across when the new context arrives (engine thread)."""

    def __init__(self, llama: LlamaContext, capacity: Capacity,
                 post: Callable[[Command], None], reserve: Reserve | None = None) -> None:
        self.llama, self.capacity, self.post, self.reserve = llama, capacity, post, reserve
        self.resizes = 0
        self._native: list[threading.Thread] = []  # builds and frees on the model, under way
        self._lock = threading.Lock()  # a finished build is posted, or freed once stopped
        self._stopped = False
        self._posted: Any = None  # a context posted and not yet applied

    def rest(self, served: bool) -> None:
        """Engine thread, at rest: once the model has served, the reserve is made on a
        builder thread."""
        reserve = self.reserve
        if reserve is not None and reserve.pending and served \
                and self.capacity.state is GrowthState.STEADY \
                and self.llama.streams < reserve.streams:
            reserve.start()

    def tick(self, busy: int, waiting: int, now: float, warm: int = 0) -> None:
        # Warm conversations count only where their streams cost no memory until used:
        # with the reserve made (or adopted). Elsewhere (a GPU's KV) they share one stream.
        reserve = self.reserve is not None and (self.reserve.ready() or self.capacity.on_reserve)
        target = self.capacity.want(busy, waiting, now, warm if reserve else 0)
        if target is not None and target > self.capacity.streams and self.reserve is not None \
                and self.reserve.ready():
            # Growth of any size takes the reserve when there is one: nothing to build, and
            # its unused streams hold no memory, so a later burst needs no growth at all.
            target = self.capacity.target = self.reserve.streams
        if target is not None:
            log.debug("KV: %d -> %d streams (%d busy, %d waiting, %d warm)",
                      self.capacity.streams, target, busy, waiting, warm)
            self._spawn(self._build, target, "kv-resize")

    def _build(self, streams: int) -> None:
        try:
            ctx = None
            if self.reserve is not None and streams == self.reserve.streams:
                ctx = self.reserve.take()  # made while idle: no build in the burst
            ctx = ctx or self.llama.new_context(streams)
        except RunnerError as exc:
            log.warning("could not grow the KV cache to %d sequences: %s", streams, exc.message)
            ctx = None
        with self._lock:
            if not self._stopped:
                self._posted = ctx
                self.post(Resized(ctx, streams))
                return
        if ctx is not None:  # the engine stopped meanwhile: nobody will adopt it
            self.llama.discard(ctx)

    def apply(self, resized: Resized, slots: list[Slot], num_ctx: int, now: float,
              save: Callable[[Slot], None] | None = None) -> list[Slot] | None:
        """The new slots, the context adopted; None when nothing changed. Idle caches the
        new context has no room for go to `save`."""
        with self._lock:
            self._posted = None
        if resized.ctx is None:
            self.capacity.failed()
            return None
        moved = carry(slots, self.llama.ctx, resized.ctx, resized.streams, num_ctx, save)
        if moved is None:  # more are running than a smaller context holds: not now
            self._let_go(resized.ctx)
            self.capacity.failed()
            return None
        old = self.llama.adopt(resized.ctx, resized.streams)
        self._let_go(old)
        self.capacity.built(now)
        self.capacity.on_reserve = self.reserve is not None and self.reserve.owns(resized.ctx)
        self.resizes += 1
        return moved

    def kv_held(self, current: int, ctx: Any) -> int:
        """Bytes of KV committed now, given `current`, that of `ctx`, the context the
        engine serves from (LlamaContext.kv_committed), and the reserve's while it waits."""
        reserve = self.reserve
        if reserve is None:
            return current
        return (0 if reserve.owns(ctx) else current) + reserve.committed()

    def reserve_streams(self) -> int:
        """Streams of the cap's context made ahead (runner.kv.reserve), in use or not; 0: none."""
        reserve = self.reserve
        return reserve.streams if reserve is not None and reserve.made() else 0

    def _let_go(self, ctx: Any) -> None:
        """A context the engine no longer serves from: the reserve's goes back to it, and
        any other is freed on a thread of its own (unmapping a big KV takes a while)."""
        if self.reserve is not None and self.reserve.owns(ctx):
            self.reserve.put_back(ctx)
            return
        self._spawn(self.llama.discard, ctx, "kv-free")

    def _spawn(self, target: Callable[[Any], None], arg: Any, name: str) -> None:
        """A build or a free on a thread of its own, which `free` waits for."""
        self._native = [t for t in self._native if t.is_alive()]
        thread = threading.Thread(target=target, args=(arg,), daemon=True, name=name)
        thread.start()
        self._native.append(thread)

    def free(self) -> bool:
        """Before the model goes: the builds and frees under way end first (a context made
        from a model already freed aborts the process). False if one is still inside
        llama.cpp after the wait: the model must then stay, for the process exit."""
        with self._lock:
            self._stopped = True
        for thread in self._native:
            thread.join(timeout=30)
        with self._lock:  # posted after the engine's last look at its commands
            unread, self._posted = self._posted, None
        if unread is not None:
            self.llama.discard(unread)
        reserve_done = self.reserve.free() if self.reserve is not None else True
        return reserve_done and not any(t.is_alive() for t in self._native)
