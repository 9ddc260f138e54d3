"""The second part of an engine step: every native call its plan asks for (schedule ->
run -> postprocess; runner.engine.engine has the loop).

In order: the plan's KV ops (runner.engine.kvops), the samplers of sequences placed for
the first time, one llama_decode of the token batch; then, once postprocess has sampled
that batch (a decode overwrites the logits of the one before), the image slice through
the embeddings batch, which postprocess finishes in turn. A placement whose Trim,
Restore or Branch fails (a state llama.cpp refuses, a partial removal a recurrent memory
cannot make, a branch from a donor that failed) leaves its slot's planned rows wrong,
and so does a sampler that cannot be made: then the remaining ops still run, the other
streams' rows decode without theirs (Batch.without), and postprocess puts those slots
right; the next step plans them again.
A failed decode is recovered here (kvops.recover); what recovery cannot save,
postprocess fails.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import llama_cpp as L

from corral.errors import BadRequest
from corral.runner.cache.caches import PrefixCaches
from corral.runner.engine import kvops
from corral.runner.engine.kvops import KVOps
from corral.runner.engine.batchplan import Batch, BatchRow
from corral.runner.engine.kvplan import save_op
from corral.runner.engine.plan import ImageSlice, Mark, Placed, StepPlan, Trim
from corral.runner.llama import native
from corral.runner.llama.sampling import for_job
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.jobs import ImageSpan
    from corral.runner.llama.context import LlamaContext
    from corral.runner.speculative.speculation import Speculation

log = logging.getLogger("corral.engine")
# The largest state copied into the prompt cache at rest (Run.presave): a longer copy is
# no longer nothing beside a request that comes meanwhile.
PRESAVE_MAX = 64 << 20


@dataclass
class Outcome:
    """What running a plan (or its image slice) gave, for postprocess."""

    failed: list[Placed] = field(default_factory=list)  # their prefix did not go in place
    refused: list[tuple[Placed, BadRequest]] = field(default_factory=list)  # no sampler
    # What was decoded: the plan's batch, less the rows of placements that failed here
    batch: Batch = field(default_factory=Batch)
    decoded: bool = False  # the decode ran (rc says how)
    rc: int = 0
    lost: list[Slot] = field(default_factory=list)  # a failed decode recovery could not save
    native: float = 0.0  # seconds in llama_decode

    def skipped(self) -> set[int]:
        """The sequences whose placement failed: left out of this step's decodes."""
        return {p.slot.seq_id for p in self.failed} | {p.slot.seq_id for p, _ in self.refused}

    @property
    def ok(self) -> bool:
        """The decode ran and succeeded: its logits are there to sample."""
        return self.decoded and self.rc == 0


class Run:
    """Run's side of the engine, on the engine thread: it reads the context's fields from
    its LlamaContext at each step, so a resize (runner.kv.growth) needs nothing here."""

    def __init__(self, llama: "LlamaContext", caches: PrefixCaches, pooled: bool,
                 clock: Callable[[], float], spec: "Speculation | None" = None) -> None:
        """`spec`: speculative decoding, which hears each token batch that decoded before
        any other decode runs (an MTP head reads the model's states of its rows:
        runner.speculative.mtp)."""
        self.llama, self.caches, self.pooled, self.clock = llama, caches, pooled, clock
        self.spec = spec
        self.feed = ImageFeed(llama)

    def step(self, plan: StepPlan, slots: list[Slot]) -> Outcome:
        """The plan's ops, new samplers, and the token batch."""
        out = Outcome(batch=plan.batch)
        failed = self.ops(plan)
        out.failed = [p for p in plan.placed if p.slot.seq_id in failed]
        out.refused = self._samplers(plan.placed)
        if out.failed or out.refused:  # their rows are wrong: the other streams go on
            log.debug("a placement failed (%d prefixes, %d samplers): planned again",
                      len(out.failed), len(out.refused))
            out.batch = plan.batch.without(out.skipped())
        out.decoded = True
        llama = self.llama
        if out.batch.rows:
            native.fill_batch(llama.batch, out.batch.rows, llama.n_batch)
            t0 = self.clock()
            out.rc = int(L.llama_decode(llama.ctx, llama.batch))
            out.native += self.clock() - t0
            if out.rc != 0:
                out.lost = self._recover(out.rc, out.batch.slots, slots)
            elif self.spec is not None:
                self.spec.decoded(out.batch.rows)
        return out

    def ops(self, plan: StepPlan) -> set[int]:
        """The plan's KV ops, in order; the sequences whose ops failed. The engine runs
        them whether or not the step decodes: a plan with nothing to decode can still free
        cells (a cancelled keystroke's parked run), and a cell that outlives its owner is
        one the slots believe free."""
        ops = self._ops()
        for op in plan.ops:
            ops.run(op)
        return ops.failed

    def image(self, image: ImageSlice, slots: list[Slot]) -> Outcome:
        """The plan's image slice, through the embeddings batch. Its decode overwrites the
        logits of the token batch, so the engine calls it once postprocess sampled those."""
        out = Outcome(decoded=True)
        t0 = self.clock()
        out.rc = self.feed.decode(image.slot, image.span, image.offset, image.count,
                                  logits_last=image.last)
        out.native += self.clock() - t0
        if out.rc != 0:
            out.lost = self._recover(out.rc, [image.slot], slots)
        return out

    def _ops(self) -> KVOps:
        # One KV stream in pool mode; else a stream a slot (runner.kv.growth keeps them equal).
        return KVOps(self.llama.ctx, self.llama.mem, self.caches,
                     1 if self.pooled else self.llama.streams, self.llama.cuts,
                     self.llama.window_whole if self.llama.window else None)

    def _samplers(self, placed: list[Placed]) -> list[tuple[Placed, BadRequest]]:
        """A new sequence's sampler, made here where every native call of the step is, when
        it first gets a slot: a grammar that does not parse is this request's 400 alone,
        as a Failed event like any other end, and only a sequence that runs holds one."""
        refused = []
        llama = self.llama
        for p in placed:
            if not p.new:
                continue  # a preempted sequence kept its own
            job = p.seq.job
            eog = llama.eog_tokens() if job.ignore_eos else None
            try:
                p.seq.sampler = for_job(job, p.tokens, llama.vocab, llama.n_vocab,
                                        llama.num_ctx, eog)
            except BadRequest as exc:
                refused.append((p, exc))
        return refused

    def _recover(self, rc: int, failed: list[Slot], slots: list[Slot]) -> list[Slot]:
        """The slots a failed decode loses: none when dropping idle caches made room."""
        log.error("llama_decode returned %d", rc)
        return [] if kvops.recover(self.llama.mem, rc, failed, slots) else failed

    def trim(self, cuts: list[Trim | Mark]) -> set[int]:
        """Rejected drafts' cells and prompts' last tokens taken back, with the state read
        there (postprocess found them), at the end of the step; the sequence ids whose
        cells would not go (their slots cannot go on)."""
        ops = self._ops()
        for op in cuts:
            ops.run(op)
        return ops.failed

    def redo(self, slots: list[Slot]) -> None:
        """The tokens idle slots owe (runner.slots.slot Owed) decoded again, in one batch,
        at rest (runner.engine.housekeeping): a slot, and a save of it to the prompt
        cache, then holds its whole prompt. Not for a slot changed since (its length is
        not the owed one's), nor one a context shift changed. A decode that fails drops
        their cells: a cache is lost, no state is left half-made."""
        owing = [(s, owed) for s in slots if (owed := s.owed) is not None
                 and s.state is SlotState.IDLE and not s.tainted and s.n_past == owed.held]
        for slot in slots:
            slot.owed = None
        if not owing:
            return
        rows = [BatchRow(owed.token, owed.pos, slot.seq_id, False) for slot, owed in owing]
        llama = self.llama
        native.fill_batch(llama.batch, rows, llama.n_batch)
        if L.llama_decode(llama.ctx, llama.batch) != 0:
            log.error("a prompt's last token could not be decoded again: its cache goes")
            for slot, _ in owing:
                kvops.drop(llama.mem, slot)
            return
        if self.spec is not None:
            self.spec.decoded(rows)
        for slot, owed in owing:
            slot.cached.append(owed.token)

    def presave(self, slots: list[Slot]) -> None:
        """The idle slot a new conversation would take, copied into the prompt cache at
        rest, as that placement would copy it, but off its first token's time (a 5 MB
        hybrid state was a millisecond of it, and its page faults two more). The slot a
        prompt sharing nothing takes is the least recently used (runner.engine.placer,
        its ties). At most PRESAVE_MAX (a bigger state is left to the placement), and
        where the budget has room beside the entries: no entry goes for a copy of cells
        the KV still holds. A next turn in the slot continues the entry, and the next
        save drops it (PromptCache.add)."""
        idle = [s for s in slots if s.state is SlotState.IDLE]
        if not idle:
            return
        slot = min(idle, key=lambda s: s.last_used)
        op = save_op(slot, self.caches, held=[s.reusable() for s in slots if s is not slot])
        if op is None:
            return
        ram = self.caches.ram
        size = L.llama_state_seq_get_size(self.llama.ctx, slot.seq_id)
        if size <= PRESAVE_MAX and ram.size + size <= ram.budget:
            self._ops().run(op)

    def save(self, slot: Slot) -> None:
        """An idle slot's cache into the prompt cache, if worth it (a resize leaves it behind)."""
        op = save_op(slot, self.caches)
        if op is not None:
            self._ops().run(op)


class ImageFeed:
    """The embeddings batch, used only by the engine thread."""

    def __init__(self, llama: "LlamaContext") -> None:
        self.llama = llama
        self.n_embd = L.llama_model_n_embd_inp(llama.model)
        # M-RoPE models (Qwen2-VL and later) take four positions an embedding
        self.mrope = native.mrope(llama.model)
        self.batch: Any = None  # allocated at the first image

    def decode(self, slot: Slot, span: "ImageSpan", offset: int, count: int,
               logits_last: bool) -> int:
        n_batch, ctx = self.llama.n_batch, self.llama.ctx
        if self.batch is None:
            self.batch = L.llama_batch_init(n_batch * (4 if self.mrope else 1), self.n_embd, 1)
        rows = span.embd[offset:offset + count]
        assert rows.shape == (count, self.n_embd) and 0 < count <= n_batch
        batch = self.batch
        ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
        for i in range(count):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot.seq_id
            batch.logits[i] = logits_last and i == count - 1
        self._positions(span, slot.pos(span.start), offset, count)
        batch.n_tokens = count
        if span.non_causal:
            L.llama_set_causal_attn(ctx, False)
        try:
            return int(L.llama_decode(ctx, batch))
        finally:
            if span.non_causal:
                L.llama_set_causal_attn(ctx, True)

    def _positions(self, span: "ImageSpan", p0: int, offset: int, count: int) -> None:
        """The rows' positions: one each from the span's first; with M-RoPE four, section
        after section (time, row, column, unused), as mtmd's helper lays them out: an
        image's tokens all at p0 in time and at their column and row on its grid
        (mtmd_image_tokens_get_decoder_pos), an audio window's at p0 + i in all four."""
        pos = self.batch.pos
        for i in range(count):
            k = offset + i
            if not self.mrope:
                pos[i] = p0 + k
            elif span.grid is not None:
                columns = span.grid[0]
                pos[i], pos[count + i] = p0, p0 + k // columns
                pos[2 * count + i], pos[3 * count + i] = p0 + k % columns, 0
            else:
                for section in range(4):
                    pos[section * count + i] = p0 + k

    def free(self) -> None:
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
