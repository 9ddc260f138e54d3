"""The first part of an engine step: decide it, as a plan (runner.engine.plan), for run to
execute and postprocess to finish (schedule -> run -> postprocess; runner.engine.engine has
the loop).

In order: cancelled requests end; a parked infill run joins its slot, or goes; the
placer (runner.engine.placer) admits waiting sequences onto idle slots, each with the
ops that put its prefix there (kept, branched from another slot or restored from the
prompt cache: runner.engine.kvplan); slots at num_ctx shift their context or end;
runner.engine.batchplan chooses the batch, with each decoding slot's draft where
speculative decoding asks for one (runner.speculative); a KV pool that would overflow
goes without the drafts, then drops idle caches, then preempts (runner.engine.kvpool);
and one slice of a waiting image is chosen if the pool holds it too.

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
from corral.runner.engine.batchplan import Batch, Drafter, plan_step
from corral.runner.engine.kvpool import KVPool
from corral.runner.engine.placer import Placement, Placer, Refusal, Source
from corral.runner.engine.plan import (Demand, Drop, End, ImageSlice, Join, Park, Placed,
                                       StepPlan)
from corral.runner.slots.sequence import DoneReason, SeqState
from corral.runner.slots.slot import Slot, SlotState
from corral.runner.speculative.cost import RowCost

if TYPE_CHECKING:
    from corral.runner.kv.growth import Capacity
    from corral.runner.speculative.ngram import DraftSource, History

log = logging.getLogger("corral.engine")


class Schedule:
    def __init__(self, placer: Placer, caches: PrefixCaches, pool: KVPool | None,
                 num_ctx: int, n_batch: int, can_shift: bool, clock: Callable[[], float],
                 capacity: "Capacity | None" = None, scratch: int | None = None,
                 index: "DraftSource | None" = None, cost: RowCost | None = None) -> None:
        """`capacity`: elastic KV's policy, where the context can grow (runner.kv.growth);
        each plan then carries what to tell it after the step. `scratch`: the context's
        scratch sequence (runner.llama.context), where one infill's cached suffix at a
        time waits while the text typed before it is decoded (kvplan.reuse_moves).
        `index`: where decoding slots' drafts come from (runner.speculative: the n-gram
        index, or a draft model's proposals), and `cost` whether they pay for their rows;
        None, speculative decoding is off."""
        self.placer, self.caches, self.pool, self.capacity = placer, caches, pool, capacity
        self.num_ctx, self.n_batch, self.can_shift, self.clock = (num_ctx, n_batch,
                                                                  can_shift, clock)
        self.overwritten = 0  # warm prefixes placements overwrote since the last demand
        self.scratch, self.index, self.cost = scratch, index, cost or RowCost()
        self.parked: Slot | None = None  # the slot whose run waits on the scratch sequence
        self.parked_new = False  # its sequence was placed for the first time

    def plan(self, slots: list[Slot]) -> StepPlan:
        """The next step; `busy` false when no slot holds a sequence (then only its
        `ends`, if any, go out)."""
        plan = StepPlan()
        self._reap_cancelled(slots, plan)
        self._unpark(plan)
        self._admit(slots, plan)
        active = sum(s.state is not SlotState.IDLE for s in slots)
        if self.capacity is not None:
            plan.demand = self._demand(slots, active)
        if not active:
            return plan
        plan.busy = True
        for slot in slots:
            if slot.state is SlotState.DECODE and slot.n_past >= self.num_ctx:
                self._shift(slot, plan)
        plan.batch = plan_step(slots, self.n_batch, self._drafter(), self._even(slots))
        if self.pool is not None:  # make the pool hold this step: drop caches, then preempt
            plan.batch = self._fit(slots, plan)
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
        ops, n_prefix, moved = kvplan.placement_ops(
            p, self.caches, [s.reusable() for s in slots if s is not slot], self.can_shift,
            self.scratch if self.parked is None else None)
        plan.ops += ops
        park = next((op for op in ops if isinstance(op, Park)), None)
        # Moved or parked KV is approximate: only requests that take it may reuse the slot.
        kept = n_prefix > 0 or park is not None
        shifted = (slot.tainted or moved) and kept and p.source in (Source.NONE, Source.REUSE)
        slot.assign(seq, tokens[:n_prefix], shifted=shifted)
        if new:  # its sampler is run's to make (runner.engine.run)
            seq.start(generation_limit(job, len(tokens), self.num_ctx), tokens, n_prefix, now)
            if self.index is not None:
                self.index.add(seq.history)  # its prompt: what it most likely quotes
        else:
            seq.resume(tokens, n_prefix)
        plan.placed.append(Placed(slot, seq, tokens, new))
        if park is not None:
            slot.join_at, slot.parked, self.parked = park.dst, park.n, slot
            self.parked_new = new  # a resumed sequence's count is its first placement's

    def _drafter(self) -> "Drafter | None":
        return self._draft if self.index is not None else None

    def _even(self, slots: list[Slot]) -> bool:
        """Whether each slot has a KV stream of its own (batchplan.plan_step: even drafts)."""
        return self.pool is None and len(slots) > 1

    def _draft(self, slot: Slot, decoding: int) -> list[int]:
        """The tokens a decoding slot verifies after its next one this step: as many as
        its policy asks (runner.speculative.policy), and no more than it may still
        generate or its context holds, from where its last tokens came before
        (runner.speculative.ngram); none where they are not likely enough kept to pay for
        their rows (runner.speculative.cost)."""
        seq = slot.sequence
        assert seq is not None and self.index is not None
        n = seq.draft.want(decoding, self._room(slot))
        if n <= 0 or not self._pays(slot, decoding):
            return []
        return self.index.draft(seq.history, n)

    def draft_wants(self, slots: list[Slot]) -> list[tuple[int, "History", int]]:
        """What a draft model (runner.speculative.draftmodel) should propose after this
        step, read without changing anything: each decoding sequence that will draft at
        the next one, and as many tokens as its policy may then ask, within the rows the
        batch leaves each (batchplan.plan_step's `spare`). Where every slot has a KV stream
        of its own, plan_step cuts all drafts to the shortest: then none is proposed while
        one decoding slot will not draft, and none longer than the shortest want."""
        decoding = [s for s in slots if s.state is SlotState.DECODE and s.sequence is not None]
        spare = (self.n_batch - len(decoding)) // max(len(decoding), 1)
        even = self._even(slots)
        out = []
        for slot in decoding:
            seq = slot.sequence
            assert seq is not None
            n = min(seq.draft.ready(len(decoding), self._room(slot)), spare)
            if n > 0 and self._pays(slot, len(decoding)):
                out.append((slot.seq_id, seq.history, n))
            elif even:
                return []  # its empty draft would cut every other one to nothing
        if even and out:
            least = min(n for _, _, n in out)
            out = [(seq_id, history, least) for seq_id, history, _ in out]
        return out

    def _room(self, slot: Slot) -> int:
        """What the slot's sequence may still generate, less the token it decodes anyway."""
        seq = slot.sequence
        assert seq is not None
        return min(seq.limit - seq.n_generated - 1, self.num_ctx - slot.n_past - 1)

    def _pays(self, slot: Slot, decoding: int) -> bool:
        """Whether the sequence's drafts are kept often enough to pay for their rows. Each
        drafts once before the odds decide: its own text may be a copy where the
        runner's last requests were not."""
        draft = slot.sequence.draft if slot.sequence is not None else None
        return draft is not None and (not draft.drafted or
                                      self.cost.expects(draft) >= self.cost.needed(decoding))

    def _unpark(self, plan: StepPlan) -> None:
        """The parked run joins its slot once the typed tokens before it are in the KV
        (its cached tokens, and its sequence's evaluated count, take the run in); it goes
        when its sequence left the slot (ended, failed, preempted, moved)."""
        slot = self.parked
        if slot is None or self.scratch is None:
            return
        seq = slot.sequence
        if slot.join_at < 0 or seq is None:
            plan.ops.append(Drop(self.scratch))
        elif slot.n_past == slot.join_at:
            plan.ops.append(Join(slot.seq_id, self.scratch, slot.join_at, slot.parked))
            slot.cached.extend(seq.pending[:slot.parked])
            del seq.pending[:slot.parked]
            if self.parked_new:
                seq.n_prompt_eval -= slot.parked
            slot.join_at, slot.parked = -1, 0
        else:
            return  # its typed tokens are still being decoded
        self.parked = None

    def moved(self, scratch: int | None) -> None:
        """The engine moved to a new context (runner.kv.growth), which did not take the
        scratch sequence's cells: a parked run is evaluated with the prompt instead."""
        if self.parked is not None:
            self.parked.join_at, self.parked.parked = -1, 0
        self.scratch, self.parked = scratch, None

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
        # Tokens after the cut were computed beside tokens that are gone, and a
        # sliding-window cache keeps more than the positions say: none of this
        # sequence is what a fresh prefill of its tokens would give.
        slot.tainted = True

    def _end(self, slot: Slot, reason: DoneReason, plan: StepPlan) -> None:
        seq = slot.vacate(self.clock())
        assert seq is not None
        self._unpark(plan)
        if self.pool is not None:
            self.pool.pressure = False  # cells came free: waiting jobs may try again
        plan.ends.append(End(seq, reason))

    def _fit(self, slots: list[Slot], plan: StepPlan) -> Batch:
        """Drop idle caches, then preempt, until the pool holds the step. Drafts are
        rows that may be given back the same step: a step that does not fit with them
        goes without them, and nothing is evicted or preempted for a guess."""
        assert self.pool is not None
        batch = plan.batch
        if batch.drafts and self.pool.relief(slots, len(batch.rows)) is not None:
            batch = plan_step(slots, self.n_batch)
        while batch.rows and (relief := self.pool.relief(slots, len(batch.rows))) is not None:
            if relief.preempt:
                self._preempt(relief.slot, plan)
                batch = plan_step(slots, self.n_batch)
            else:
                self._drop(relief.slot, plan)
        return batch

    def _drop(self, slot: Slot, plan: StepPlan) -> None:
        """An idle slot's cache goes for room in the pool: to the prompt cache first."""
        save = kvplan.save_op(slot, self.caches)
        if save is not None:
            plan.ops.append(save)
        plan.ops.append(Drop(slot.seq_id))
        slot.cached = []

    def _preempt(self, slot: Slot, plan: StepPlan) -> None:
        assert self.pool is not None
        plan.ops.append(Drop(slot.seq_id))
        slot.cached = []
        seq = slot.vacate(self.clock())
        assert seq is not None
        self._unpark(plan)  # its parked run, if any, goes now: the pool counts it no more
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
        if self.pool is not None and self.pool.shortfall(slots, rows + image.count) > 0:
            return None
        return image
