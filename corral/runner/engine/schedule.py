"""The first part of an engine step: decide it, as a plan (runner.engine.plan), for run to
execute and postprocess to finish (schedule -> run -> postprocess; runner.engine.engine has
the loop).

In order: cancelled requests end; a parked infill run joins its slot, or goes
(runner.engine.parking); the placer (runner.engine.placer) admits waiting sequences onto
idle slots, each with the ops that put its prefix there (kept, branched from another
slot or restored from the prompt cache: runner.engine.kvplan); slots at num_ctx shift
their context or end; on a memory that cannot be cut anywhere (recurrent, a window
cache: runner.prefix Cuts), prefilling slots have their state read where a later prompt
is likely to go back to (checkpoints: `_marks`, `_stops`);
runner.engine.batchplan chooses the batch, with the drafts speculation made for the
decoding slots after the step before (runner.speculative.speculation); a KV pool that
would overflow goes without the drafts, then drops idle caches, then preempts
(runner.engine.kvpool); and one slice of a waiting image is chosen if the pool holds it
too.

Pure: it updates Python bookkeeping as each decision is made (slots' and sequences'
state machines, what each slot caches, the placer's queue, the pool's counters), so
later decisions see the state the earlier ops leave, and makes no native call. Ends
are delivered, and samplers made and freed, by the native parts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from corral.runner.cache.caches import PrefixCaches
from corral.runner.engine import imagefeed, kvplan
from corral.runner.engine.admission import generation_limit
from corral.runner.engine.batchplan import Batch, plan_step
from corral.runner.engine.kvpool import KVPool
from corral.runner.engine.parking import Parking
from corral.runner.engine.placer import Placement, Placer, Refusal, Source
from corral.runner.engine.plan import (Demand, Drop, End, ImageSlice, Mark, Park, Placed,
                                       StepPlan)
from corral.runner.prefix import Cuts
from corral.runner.slots.sequence import DoneReason, SeqState
from corral.runner.slots.slot import Slot, SlotState
from corral.runner.speculative.speculation import Ask, Candidate

if TYPE_CHECKING:
    from corral.runner.kv.growth import Capacity
    from corral.runner.speculative.speculation import Speculation

# Tokens between the checkpoints read through a long prompt (where they are read)
CHECKPOINT_EVERY = 4096
# A window cache's slot reads no checkpoint this close after one it holds (a quarter
# window at most): its own state is cut back within the window without one (a
# regenerate, an edit), and a restore from the prompt cache reads these few tokens
# again. A burst's requests, each placed a few tokens before its prompt's end, read one
# checkpoint each, not two (llama.cpp reads a sequence's window cell by cell from the
# shared ring: ~30 ms each on the base starter, 14% of a burst's engine time), and their
# prefills do not stop one token short of the end for a second (`_stops`).
MARK_SPACING = 32
# The tokens a chat template puts after a prompt's last message, at most (ChatML's end of
# turn and the answer's opening: six on the chat starter's vocabulary; Llama 3's five):
# where the message ends is looked for among them (Schedule._message_end).
TEMPLATE_TAIL = 8

log = logging.getLogger("corral.engine")


class Schedule:
    def __init__(self, placer: Placer, caches: PrefixCaches, pool: KVPool | None,
                 num_ctx: int, n_batch: int, can_shift: bool, clock: Callable[[], float],
                 capacity: "Capacity | None" = None, scratch: int | None = None,
                 spec: "Speculation | None" = None, cuts: Cuts = Cuts(),
                 control: Callable[[int], bool] = lambda token: False) -> None:
        """`capacity`: elastic KV's policy, where the context can grow (runner.kv.growth);
        each plan then carries what to tell it after the step. `scratch`: the context's
        scratch sequence (runner.llama.context), where one infill's cached suffix at a
        time waits while the text typed before it is decoded (runner.engine.parking).
        `spec`: speculative decoding (runner.speculative.speculation), which made the
        decoding slots' drafts after the step before; None, it is off. `cuts`: where the
        memory can be cut back; where it cannot be cut anywhere, slots keep checkpoints,
        a slot's state read where a later prompt is likely to go back to (`_marks`).
        `control`: whether a token is one of the vocabulary's control tokens (a chat
        template's: where a prompt's last message ends, `_points`)."""
        self.placer, self.caches, self.pool, self.capacity = placer, caches, pool, capacity
        self.num_ctx, self.n_batch, self.can_shift, self.clock = (num_ctx, n_batch,
                                                                  can_shift, clock)
        self.overwritten = 0  # warm prefixes placements overwrote since the last demand
        self.spec = spec
        self.cuts, self.checkpoints, self.control = cuts, cuts.checkpoints > 0, control
        self.parking = Parking(scratch)

    def plan(self, slots: list[Slot]) -> StepPlan:
        """The next step; `busy` false when no slot holds a sequence (then only its
        `ends`, if any, go out)."""
        plan = StepPlan()
        self._reap_cancelled(slots, plan)
        plan.ops += self.parking.settle()
        self._admit(slots, plan)
        active = sum(s.state is not SlotState.IDLE for s in slots)
        if self.capacity is not None:
            plan.demand = self._demand(slots, active)
        if not active:
            return plan
        plan.busy = True
        for slot in slots:
            if slot.state is SlotState.DECODE and slot.n_past + len(slot.pending) >= self.num_ctx:
                self._shift(slot, plan)
        if self.checkpoints:
            self._marks(slots, plan)
        plan.batch = self._batch(slots, plan, self._drafts(slots))
        if self.pool is not None:  # make the pool hold this step: drop caches, then preempt
            plan.batch = self._fit(slots, plan)
        if self.checkpoints and self.cuts.takeback:
            plan.retake = self._retakes(plan)
        plan.image = self._image(slots, len(plan.batch.rows))
        return plan

    def _reap_cancelled(self, slots: list[Slot], plan: StepPlan) -> None:
        # A queued request whose client has gone is dropped without running.
        waiting = self.placer.waiting
        for seq in [s for s in waiting if s.job.cancelled.is_set()]:
            waiting.remove(seq)
            plan.ends.append(End(seq, DoneReason.CANCEL, stats=False))
        for slot in slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                self._end(slot, DoneReason.CANCEL, plan)

    def _admit(self, slots: list[Slot], plan: StepPlan) -> None:
        while (decision := self.placer.next(slots)) is not None:
            if isinstance(decision, Refusal):
                plan.ends.append(End(decision.seq, error=decision.error))
            else:
                self._place(decision, slots, plan)

    def _place(self, p: Placement, slots: list[Slot], plan: StepPlan) -> None:
        """Start (or resume) a sequence on its slot, with the prefix the placer chose."""
        seq, job, tokens, slot = p.seq, p.seq.job, p.tokens, p.slot
        new = seq.state is not SeqState.PREEMPTED
        if new:
            job.prompt = tokens
        now = self.clock()
        reused = p.n_prefix if p.source is Source.REUSE else 0
        if self.capacity is not None and self.capacity.warm(len(slot.cached) - reused,
                                                            slot.last_used, now):
            self.overwritten += 1  # another conversation's prefix goes: want a stream more
        # Reuse chunks move cells within the slot's KV: not where a cut there would miss
        # KV the memory did not keep.
        ops, n_prefix, moved = kvplan.placement_ops(
            p, self.caches, [s.reusable() for s in slots if s is not slot],
            self.can_shift and self.cuts.anywhere(len(slot.cached)), self.parking.free())
        plan.ops += ops
        park = next((op for op in ops if isinstance(op, Park)), None)
        # Moved or parked KV is approximate: only requests that take it may reuse the slot.
        kept = n_prefix > 0 or park is not None
        shifted = (slot.tainted or moved) and kept and p.source in (Source.NONE, Source.REUSE)
        slot.assign(seq, tokens[:n_prefix], shifted=shifted)
        if p.source is not Source.REUSE or p.checkpoint is not None:  # a state copied in
            slot.window_from = max(n_prefix - (self.cuts.below or 0), 0)
        if p.source not in (Source.NONE, Source.REUSE):  # another sequence's state now:
            # the checkpoints are the entry's, where they hold (the slot's own went)
            held = p.entry.checkpoints if p.entry is not None else p.checkpoints
            slot.checkpoints = [c for c in held if c[0] <= n_prefix] \
                if p.source is Source.RESTORE else []
        if new:  # its sampler is run's to make (runner.engine.run)
            seq.start(generation_limit(job, len(tokens), self.num_ctx), tokens, n_prefix, now)
            if self.spec is not None:
                self.spec.started(seq.history)
        else:
            seq.resume(tokens, n_prefix)
        plan.placed.append(Placed(slot, seq, tokens, new))
        if park is not None:
            self.parking.park(slot, park, new)

    def _batch(self, slots: list[Slot], plan: StepPlan,
               drafts: dict[int, list[int]] | None = None) -> Batch:
        return plan_step(slots, self.n_batch, drafts or {}, self._stops(slots, plan))

    def _stops(self, slots: list[Slot], plan: StepPlan) -> dict[int, int]:
        """Where prefills stop this step: where a parked run joins its slot, where
        sequences held for a slot's prefix branch from it (the placer's `holds`: only
        where its memory could not be cut back there after), and, where checkpoints are
        read, at the next point its state is read (`_marks`). Not at a point whose state
        would not be read (a checkpoint held or read this step is too close below it):
        a stop costs a burst a whole step of every stream's rows, and bought nothing."""
        stops = self.parking.joins()
        for seq_id, at in self.placer.holds.items():
            stops[seq_id] = min(stops.get(seq_id, at), at)
        if self.checkpoints:
            reading = self._reading(plan)
            for slot in slots:
                ahead = [n for n in self._points(slot) if n > slot.n_past
                         and not self._covered(slot, n, reading.get(slot.seq_id))]
                if ahead:
                    stops[slot.seq_id] = min(stops.get(slot.seq_id, ahead[0]), ahead[0])
        return stops

    def _points(self, slot: Slot) -> list[int]:
        """Where a prefilling slot's state is read, as llama-server reads its
        context checkpoints: one token before the prompt's end (a regenerate, the same
        prompt again, reads only that token), a batch before the end (an edit near it:
        the last message), and every CHECKPOINT_EVERY tokens through a long prompt. The
        first is no stop where the memory takes the prompt's last token back after the
        step that read it (`_retakes`); elsewhere the last token is decoded a step later
        for its logits. A read of more than a batch also stops where its last message
        ends (`_message_end`): an edit that adds to that message then reads only what it
        adds, for one step of a few rows more, against several of a whole batch. A point
        inside an image moves to where the image starts: an image goes into the memory
        in slices, or whole, and no cut of its KV may be restored."""
        job = slot.job
        if slot.state is not SlotState.PREFILL or job is None or not self._outgrows(slot):
            return []
        last = slot.n_past + len(slot.pending) - 1
        every = range(CHECKPOINT_EVERY, last - self.n_batch, CHECKPOINT_EVERY)
        # the last chunk a whole batch: the prompt's, or all of it but its last token
        points = {*every, last + 1 - self.n_batch} if self.cuts.takeback else \
            {*every, last - self.n_batch, last}
        seq = slot.sequence
        if seq is not None and seq.n_prompt_eval > self.n_batch:
            tail = (slot.cached[-TEMPLATE_TAIL:] + seq.pending[-TEMPLATE_TAIL:])[-TEMPLATE_TAIL:]
            if (back := self._message_end(tail)) > 1:
                points.add(last + 1 - back)
        for span in job.images:
            points = {span.start if span.start < n < span.end else n for n in points}
        return sorted(n for n in points if n > 0)

    def _marks(self, slots: list[Slot], plan: StepPlan) -> None:
        """A memory that cannot be cut back has its state read (a Mark) where a
        later prompt is likely to branch (`_points`), and where a prompt starts past what
        its slot kept (the end of the turn before: an edited last message goes back
        there)."""
        placed = {p.slot.seq_id for p in plan.placed}
        for slot in slots:
            if not slot.n_past or self._covered(slot, slot.n_past):
                continue
            if slot.n_past in self._points(slot) or (slot.seq_id in placed
                                                     and self._outgrows(slot)):
                plan.ops.append(Mark(slot))

    def _retakes(self, plan: StepPlan) -> set[int]:
        """The prompts this batch ends whose state one token short of their end is read
        after it: their memory takes the last token back once its logits are sampled,
        the state is read there (a Mark), and the token is decoded again with the next
        one (runner.engine.postprocess). Read so, the point a regenerate goes back to
        costs no step of its own: a prompt's tail is read in one step, where it took
        two, the second for the last token alone (llama-server's take two as well, its
        last four tokens in the second). Not where no token follows in the context, nor
        where a checkpoint is held or read close below."""
        retake, batch, reading = set(), plan.batch, self._reading(plan)
        for slot, taken in batch.prefill:
            end = slot.n_past + taken
            if slot.seq_id in batch.sample_at and 1 < end < self.num_ctx and self._outgrows(
                    slot) and not self._covered(slot, end - 1, reading.get(slot.seq_id)):
                retake.add(slot.seq_id)
        return retake

    @staticmethod
    def _reading(plan: StepPlan) -> dict[int, list[int]]:
        """Where the plan's Marks read each sequence's state (its slot's length now)."""
        return {op.seq_id: [op.slot.n_past] for op in plan.ops if isinstance(op, Mark)}

    def _message_end(self, tail: list[int]) -> int:
        """How many tokens before a prompt's end its last message ends, from the prompt's
        last TEMPLATE_TAIL tokens (`tail`): at the first control token of a chat
        template's end of turn and opening of the answer (ChatML's six, from
        <|im_end|>), where one is among them; else one."""
        for back in range(len(tail), 1, -1):
            if self.control(tail[-back]):
                return back
        return 1

    def _outgrows(self, slot: Slot) -> bool:
        """Whether the slot's sequence may grow past where its memory can be cut anywhere
        (Cuts.anywhere): not a window cache's whose prompt and the most it may generate
        stay within the window, whose ring never comes round to overwrite a position of
        it. Such a sequence reads no checkpoint: it would be read for nothing, and its
        prefill would stop a token short for it, a step of every stream's rows."""
        job = slot.job
        return job is not None and (job.num_predict < 0 or not self.cuts.anywhere(
            len(job.prompt) + job.num_predict))

    def _covered(self, slot: Slot, n: int, reading: list[int] | None = None) -> bool:
        """Whether a checkpoint the slot holds, or reads this step (`reading`), lies
        close enough below `n` that none is read at `n` (MARK_SPACING)."""
        near = max(min(MARK_SPACING, self.cuts.below // 4), 1) if self.cuts.below else 1
        held = [at for at, _ in slot.checkpoints] + (reading or [])
        return any(0 <= n - at < near for at in held)

    def _drafts(self, slots: list[Slot]) -> dict[int, list[int]]:
        """The drafts speculation made for the slots decoding now (after the step before:
        runner.speculative.speculation)."""
        if self.spec is None:
            return {}
        return self.spec.drafts({s.seq_id: s.sequence.history for s in slots
                                 if s.state is SlotState.DECODE and s.sequence is not None})

    def ask(self, slots: list[Slot]) -> Ask | None:
        """What speculation decides the next step's drafts from, read without changing
        anything: the sequences that will decode (as plan_step takes them), what each may
        still generate, and how the batch lays them out; None when it is off."""
        if self.spec is None:
            return None
        decoding = [s for s in slots if s.state is SlotState.DECODE][:self.n_batch]
        return Ask([Candidate(s.seq_id, s.sequence.draft, s.sequence.history, self._room(s),
                              s.pos(s.n_past + len(s.pending)))
                    for s in decoding if s.sequence is not None], self.n_batch,
                   self.pool is None and len(slots) > 1)

    def _room(self, slot: Slot) -> int:
        """What the slot's sequence may still generate, less the token it decodes anyway
        (and the prompt tokens taken back before it: `_retakes`)."""
        seq = slot.sequence
        assert seq is not None
        return min(seq.limit - seq.n_generated - 1,
                   self.num_ctx - slot.n_past - len(seq.pending) - 1)

    def moved(self, scratch: int | None) -> None:
        """The engine moved to a new context (runner.kv.growth), which did not take the
        scratch sequence's cells: a parked run is evaluated with the prompt instead."""
        self.parking.moved(scratch)

    def _demand(self, slots: list[Slot], active: int) -> Demand:
        """Streams in use, waiting and warm (runner.kv.growth Capacity.want)."""
        assert self.capacity is not None
        now, capacity = self.clock(), self.capacity
        warm = active + self.overwritten + sum(
            capacity.warm(len(s.cached), s.last_used, now)
            for s in slots if s.state is SlotState.IDLE)
        self.overwritten = 0
        return Demand(active, len(self.placer.waiting), now, warm)

    def _shift(self, slot: Slot, plan: StepPlan) -> None:
        op = kvplan.shift_op(slot, self.can_shift)
        if op is None:
            self._end(slot, DoneReason.LENGTH, plan)
            return
        plan.ops.append(op)
        del slot.cached[op.keep:op.keep + op.discard]
        slot.keep_checkpoints(op.keep)
        # Tokens after the cut were computed beside tokens that are gone, and a
        # sliding-window cache keeps more than the positions say: none of this
        # sequence is what a fresh prefill of its tokens would give.
        slot.tainted = True

    def _end(self, slot: Slot, reason: DoneReason, plan: StepPlan) -> None:
        seq = slot.vacate(self.clock())
        assert seq is not None
        plan.ops += self.parking.settle()  # its parked run, if any, goes now
        if self.pool is not None:
            self.pool.pressure = False  # cells came free: waiting jobs may try again
        plan.ends.append(End(seq, reason))

    def _fit(self, slots: list[Slot], plan: StepPlan) -> Batch:
        """Drop idle caches, then preempt, until the pool holds the step. Drafts are
        rows that may be given back the same step: a step that does not fit with them
        goes without them, and nothing is evicted or preempted for a guess."""
        assert self.pool is not None
        batch = plan.batch
        parked = self.parking.cells
        if batch.drafts and self.pool.relief(slots, len(batch.rows), parked) is not None:
            batch = self._batch(slots, plan)
        while batch.rows and (relief := self.pool.relief(slots, len(batch.rows),
                                                          self.parking.cells)) is not None:
            if relief.preempt:
                self._preempt(relief.slot, plan)
                batch = self._batch(slots, plan)
            else:
                self._drop(relief.slot, plan)
        return batch

    def _drop(self, slot: Slot, plan: StepPlan) -> None:
        """An idle slot's cache goes for room in the pool: to the prompt cache first."""
        save = kvplan.save_op(slot, self.caches)
        if save is not None:
            plan.ops.append(save)
        plan.ops.append(Drop(slot.seq_id))
        slot.cached, slot.checkpoints = [], []

    def _preempt(self, slot: Slot, plan: StepPlan) -> None:
        assert self.pool is not None
        plan.ops.append(Drop(slot.seq_id))
        slot.cached, slot.checkpoints = [], []
        seq = slot.vacate(self.clock())
        assert seq is not None
        plan.ops += self.parking.settle()  # its parked run goes now: the pool counts it no more
        seq.preempt()  # it keeps its sampler, streams and tokens: nothing is copied
        self.placer.requeue(seq)
        self.pool.preemptions += 1
        self.pool.pressure = True
        log.debug("preempted a sequence after %d tokens", seq.n_generated)

    def _image(self, slots: list[Slot], rows: int) -> ImageSlice | None:
        """One slice of the oldest waiting image, if the pool holds it beside the rows
        (else the next token batches free cells or preempt, and it waits till then)."""
        slot = imagefeed.waiting(slots)
        if slot is None:
            return None
        image = imagefeed.next_slice(slot, self.n_batch)
        if self.pool is not None and self.pool.shortfall(slots, rows + image.count,
                                                         self.parking.cells) > 0:
            return None
        return image
