"""The third part of an engine step: what the batch gave advances each sequence, and
what schedule ended is told (schedule -> run -> postprocess; runner.engine.engine has
the loop).

Ends the plan holds go out first, before run (Done or Failed; a sequence's end frees
its native sampler). Placements that failed at run are put right: a slot whose prefix
did not go in place caches nothing and prefills its whole prompt from the next step (the prompt
cache counted the refusal already), a sequence whose sampler could not be made fails
alone. Slots a failed decode lost fail. Then, when the batch ran, prompt chunks become
cached KV; a slot whose prompt is done moves to DECODE; a slot with logits samples its
next token, which goes through the UTF-8 and stop-string filters to its job, or
ends it (an end token, a stop string, the limit); each sequence's text from one batch goes
out as one event once the batch is sampled; a slot that drafted samples its draft's
rows in turn and keeps what the sampler picks, and the rejected rows' cells go back to
run to remove (`rejected`). The image slice, decoded after that
(its decode overwrites the batch's logits), becomes cached the same way, sampling its
last row when it ended the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import llama_cpp as L

from corral.errors import BadRequest, CorralError, RunnerError
from corral.runner.engine.batchplan import Batch
from corral.runner.engine.kvpool import KVPool
from corral.runner.engine.placer import Placer
from corral.runner.engine.plan import End, ImageSlice, Mark, Placed, StepPlan, Trim
from corral.runner.engine.run import ImageFeed, Outcome
from corral.runner.jobs import Done, Failed, Token, position
from corral.runner.llama import native
from corral.runner.slots.sequence import DoneReason, Sequence
from corral.runner.slots.slot import Owed, Slot, SlotState
from corral.runner.wire import DoneLine

if TYPE_CHECKING:
    from corral.runner.jobs import ImageSpan
    from corral.runner.llama.context import LlamaContext
    from corral.runner.speculative.speculation import Speculation


@dataclass
class Changes:
    """What a step's postprocess changed that the engine keeps count of."""

    sampled: int = 0  # tokens sampled
    native: float = 0.0  # seconds in the samplers
    freed: bool = False  # native memory came free (a grammar's): the heap may be trimmed


class Postprocess:
    """On the engine thread; it reads the context from its LlamaContext at each step."""

    def __init__(self, llama: "LlamaContext", feed: ImageFeed, placer: Placer,
                 pool: KVPool | None, clock: Callable[[], float],
                 spec: "Speculation | None" = None) -> None:
        """`spec`: speculative decoding (runner.speculative.speculation), which hears each
        sampled token and how each draft fared; None when it is off."""
        self.llama, self.feed, self.placer, self.pool, self.clock = (llama, feed, placer,
                                                                     pool, clock)
        self.spec = spec
        self._changes = Changes()
        self._cut: list[Trim | Mark] = []
        self._held: list[Sequence] = []  # sequences holding text this step gave them

    def ends(self, plan: StepPlan) -> None:
        """Deliver the ends schedule decided: first, before anything of the step runs, so
        that a step that fails after cannot lose them."""
        for end in plan.ends:
            self._deliver(end)

    def step(self, plan: StepPlan, out: Outcome) -> None:
        """The rest of a step that ran: its token batch."""
        self._put_right(out)
        if out.ok and out.batch.rows:
            self._apply(out.batch, plan.retake)
        self._send()

    def image(self, image: ImageSlice, out: Outcome) -> None:
        """The image slice decoded after the batch (runner.engine.run Run.image)."""
        self._put_right(out)
        if out.ok:
            self._image(image)
        self._send()

    def cut_back(self) -> list[Trim | Mark]:
        """The cells of drafts that were not kept, and of prompts' last tokens taken back
        (each with the Mark that reads the state there), for run to remove at once: before
        a save, a resize or a flush could read them, and before the next decode, which
        must continue the sequence's positions (runner.engine.engine)."""
        ops, self._cut = self._cut, []
        return ops

    def take(self) -> Changes:
        """What changed since the last call."""
        changes, self._changes = self._changes, Changes()
        return changes

    def _send(self) -> None:
        """Each stream's text from this batch, as one event (Sequence.send): once all of
        the batch is sampled, before the image slice or the next step's drafts run."""
        for seq in self._held:
            seq.send()
        self._held.clear()

    def _put_right(self, out: Outcome) -> None:
        for p in out.failed:
            self._reset(p)
        for p, error in out.refused:
            if p.slot.sequence is p.seq:
                p.slot.vacate(self.clock())
            else:  # preempted in the step that placed it: queued again
                self.placer.waiting.remove(p.seq)
            p.seq.end(Failed(error))
        for slot in out.lost:
            self.fail(slot, RunnerError(f"llama_decode failed ({out.rc})"))

    @staticmethod
    def _reset(p: Placed) -> None:
        """A placement whose prefix did not go in place: the slot holds nothing (run
        dropped its cells), and the sequence prefills all its tokens, as a placement
        with no prefix would."""
        slot, seq = p.slot, p.seq
        if slot.sequence is not seq:
            return  # preempted in the same step: its cells went, it resumes from scratch
        slot.cached, slot.tainted, slot.checkpoints = [], False, []
        seq.pending = list(p.tokens)
        if p.new:
            seq.n_prompt_eval = len(p.tokens)

    def _apply(self, batch: Batch, retake: set[int]) -> None:
        """The batch decoded: prompt chunks become cached, and slots with logits sample."""
        for slot, taken in batch.prefill:
            slot.cached.extend(slot.pending[:taken])
            del slot.pending[:taken]
            if not slot.pending:
                job = slot.job
                self._prefilled(slot)
                self._sample(slot, batch.sample_at[slot.seq_id], self.llama.batch)
                if slot.seq_id in retake and job is not None:
                    self._retake(slot, job.images)
        for slot in batch.decoding:
            if slot.state is SlotState.DECODE:
                if slot.pending:  # a prompt token read again (`_retake`)
                    slot.cached.extend(slot.pending)
                    del slot.pending[:]
                slot.cached.append(slot.last_token)
                # the tokens this batch gave the slot cells for, its draft's included
                filled = len(slot.cached) + len(batch.drafts.get(slot.seq_id, ()))
                row = batch.sample_at[slot.seq_id]
                seq = slot.sequence
                self._sample(slot, row, self.llama.batch)
                if slot.seq_id in batch.drafts:
                    assert seq is not None
                    self._verify(slot, seq, batch, row, filled)

    def _verify(self, slot: Slot, seq: Sequence, batch: Batch, row: int, filled: int) -> None:
        """The drafted tokens after the one just sampled (runner.speculative): each the
        sampler picks in turn, at the draft's own row, with the request's settings and
        random stream, is kept with its KV, exactly as plain decoding would have picked
        it (llama.cpp's common_sampler_sample_and_accept_n); the first it does not pick,
        and all after it, are not, nor any after the sequence ended. Their cells go
        (`rejected`: run removes them at the end of the step)."""
        draft, spec = batch.drafts[slot.seq_id], self.spec
        assert spec is not None
        # Counted as llama-server counts them (draft_n, draft_n_accepted): every drafted
        # token, each of which took a row of the batch, and the kept ones, as they are
        # kept (a kept one's sample may end the sequence and send its counts). The cost
        # model so prices the rows paid against the tokens kept.
        spec.counting(seq.draft, len(draft))
        accepted = 0
        for i, token in enumerate(draft):
            if slot.sequence is not seq or seq.last_token != token:
                break  # ended (an end token, a stop, the limit), or the text went elsewhere
            slot.cached.append(token)
            accepted += 1
            spec.kept(seq.draft)
            self._sample(slot, row + 1 + i, self.llama.batch)
        spec.verified(seq.draft, len(draft), accepted)
        if len(slot.cached) < filled:
            self._cut.append(Trim(slot.seq_id, position(seq.job.images, len(slot.cached)),
                                  draft=True))

    def _retake(self, slot: Slot, images: tuple["ImageSpan", ...]) -> None:
        """The prompt's last token, whose logits were just sampled, is taken back from the
        memory as a rejected draft's are, and the state one token short is read there (a
        checkpoint a regenerate goes back to: runner.engine.schedule Schedule._retakes);
        a sequence that goes on reads the token again, in the row before its next one
        (runner.engine.batchplan). One that ended leaves its slot owing the token, which
        the engine decodes again once at rest (runner.engine.run Run.redo)."""
        token = slot.cached.pop()
        if slot.sequence is not None:
            slot.sequence.pending.append(token)
        else:
            slot.owed = Owed(len(slot.cached), token, position(images, len(slot.cached)))
        self._cut += [Trim(slot.seq_id, position(images, len(slot.cached)), draft=True),
                      Mark(slot)]

    def _image(self, image: ImageSlice) -> None:
        slot, count = image.slot, image.count
        slot.cached.extend(slot.pending[:count])
        del slot.pending[:count]
        if image.last:
            self._prefilled(slot)
            self._sample(slot, count - 1, self.feed.batch)

    def _prefilled(self, slot: Slot) -> None:
        slot.transition(SlotState.DECODE)
        if slot.sequence is not None and not slot.sequence.t_first:  # a resumed one keeps its
            slot.sequence.t_first = self.clock()

    def _sample(self, slot: Slot, row: int, batch: Any) -> None:
        """The next token from `batch`'s logits at `row` (the batch just decoded)."""
        seq = slot.sequence
        assert seq is not None and seq.sampler is not None
        assert 0 <= row < batch.n_tokens and batch.logits[row]
        vocab = self.llama.vocab
        t0 = self.clock()
        try:
            token = seq.sampler.sample(self.llama.ctx, row)
        except BadRequest as exc:  # a grammar with no way on: this request's 400 alone
            return self.fail(slot, exc)
        self._changes.native += self.clock() - t0
        seq.n_generated += 1
        self._changes.sampled += 1
        seq.last_token = token
        if L.llama_vocab_is_eog(vocab, token):
            seq.sampler.take_logprobs()  # the end token is not part of the text
            self._finish(slot, DoneReason.STOP)
            return
        seq.generated.append(token)
        if self.spec is not None:
            self.spec.extended(seq.history, token)
        text = seq.utf8.feed(native.token_bytes(vocab, token, seq.job.special))
        result = seq.stops.feed(text)
        if result.text:
            if not seq.held:
                self._held.append(seq)
            seq.emit(Token(result.text, seq.sampler.take_logprobs()))
        if result.stopped:
            self._finish(slot, DoneReason.STOP, flush=False)
        elif seq.n_generated >= seq.limit:
            self._finish(slot, DoneReason.LENGTH)

    def _finish(self, slot: Slot, reason: DoneReason, flush: bool = True) -> None:
        now = self.clock()
        seq = slot.vacate(now)
        assert seq is not None
        if self.pool is not None:
            self.pool.pressure = False  # cells came free: waiting jobs may try again
        self._done(seq, reason, flush, now)

    def _deliver(self, end: End) -> None:
        """An end schedule decided (its slot, if it had one, is vacated already)."""
        if end.error is not None:
            end.seq.end(Failed(end.error))
        elif not end.stats:
            end.seq.end(Done(DoneLine(done_reason=end.reason.value)))
        else:
            self._done(end.seq, end.reason, True, self.clock())

    def _done(self, seq: Sequence, reason: DoneReason, flush: bool, now: float) -> None:
        job = seq.job
        if flush:
            tail = seq.stops.feed(seq.utf8.flush()).text + seq.stops.flush()
            if tail and reason is not DoneReason.CANCEL:
                assert seq.sampler is not None
                seq.emit(Token(tail, seq.sampler.take_logprobs()))
        self._changes.freed = self._changes.freed or job.grammar is not None
        seq.end(Done(seq.stats(reason, now)))

    def fail(self, slot: Slot, error: CorralError) -> None:
        seq = slot.vacate(self.clock())
        if seq is not None:
            seq.end(Failed(error))
