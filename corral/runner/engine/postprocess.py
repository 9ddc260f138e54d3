"""The third part of an engine step: after a batch decoded, its results advance each
sequence (schedule -> run -> postprocess; runner.engine.engine has the loop).

Prompt chunks become cached KV; a slot whose prompt is done moves to DECODE; a slot
with logits samples its next token, which is streamed through the UTF-8 and stop-string
filters to its job, or ends it (an end token, a stop string, the limit). Then one slice
of a waiting image goes through its own embeddings batch (runner.engine.imagefeed).
"""

from __future__ import annotations

from typing import Any, Callable

import llama_cpp as L

from corral.errors import BadRequest, CorralError
from corral.runner.engine import imagefeed
from corral.runner.llama import native
from corral.runner.engine.batchplan import StepPlan
from corral.runner.engine.imagefeed import ImageFeed
from corral.runner.jobs import Done, Failed, Token
from corral.runner.engine.kvpool import KVPool
from corral.runner.slots.sequence import DoneReason
from corral.runner.slots.slot import Slot, SlotState


class Postprocess:
    """The engine's postprocess step, on the engine thread (runner.engine.engine mixes it in)."""

    slots: list[Slot]
    ctx: Any
    vocab: Any
    batch: Any
    feed: ImageFeed
    pool: KVPool | None
    clock: Callable[[], float]
    sampled: int
    native_time: float
    _transient: bool

    def _decode_failed(self, rc: int, slots: list[Slot]) -> None:
        raise NotImplementedError  # the engine's: it owns recovery

    def _feed_image(self) -> None:
        """One slice of one waiting image, after the token batch: its own decode."""
        slot = imagefeed.waiting(self.slots)
        if slot is None:
            return
        span, offset, count = self.feed.slice(slot)
        if self.pool is not None and self.pool.shortfall(self.slots, count) > 0:
            return  # the next token batches free cells or preempt; it waits till then
        last = count == len(slot.pending)
        t0 = self.clock()
        rc = self.feed.decode(slot, span, offset, count, logits_last=last)
        self.native_time += self.clock() - t0
        if rc != 0:
            self._decode_failed(rc, [slot])
            return
        slot.cached.extend(slot.pending[:count])
        del slot.pending[:count]
        if last:
            self._prefilled(slot)
            self._sample(slot, count - 1, self.feed.batch)

    def _apply(self, plan: StepPlan) -> None:
        """The batch decoded: prompt chunks become cached, and slots with logits sample."""
        for slot, taken in plan.prefill:
            slot.cached.extend(slot.pending[:taken])
            del slot.pending[:taken]
            if not slot.pending:
                self._prefilled(slot)
                self._sample(slot, plan.sample_at[slot.seq_id])
        for slot in plan.decoding:
            if slot.state is SlotState.DECODE:
                slot.cached.append(slot.last_token)
                self._sample(slot, plan.sample_at[slot.seq_id])

    def _prefilled(self, slot: Slot) -> None:
        slot.transition(SlotState.DECODE)
        if slot.sequence is not None and not slot.sequence.t_first:  # a resumed one keeps its
            slot.sequence.t_first = self.clock()

    def _sample(self, slot: Slot, row: int, batch: Any = None) -> None:
        batch = self.batch if batch is None else batch  # the batch just decoded
        seq = slot.sequence
        assert seq is not None and seq.sampler is not None
        assert 0 <= row < batch.n_tokens and batch.logits[row]
        t0 = self.clock()
        try:
            token = seq.sampler.sample(self.ctx, row)
        except BadRequest as exc:  # a grammar with no way on: this request's 400 alone
            return self._fail(slot, exc)
        self.native_time += self.clock() - t0
        seq.n_generated += 1
        self.sampled += 1
        seq.last_token = token
        if L.llama_vocab_is_eog(self.vocab, token):
            seq.sampler.take_logprobs()  # the end token is not part of the text
            self._finish(slot, DoneReason.STOP)
            return
        seq.generated.append(token)
        text = seq.utf8.feed(native.token_bytes(self.vocab, token, seq.job.special))
        result = seq.stops.feed(text)
        if result.text:
            seq.job.events.put(Token(result.text, seq.sampler.take_logprobs()))
        if result.stopped:
            self._finish(slot, DoneReason.STOP, flush=False)
        elif seq.n_generated >= seq.limit:
            self._finish(slot, DoneReason.LENGTH)

    def _finish(self, slot: Slot, reason: DoneReason, flush: bool = True) -> None:
        seq = slot.sequence
        assert seq is not None
        job = seq.job
        if flush:
            tail = seq.stops.feed(seq.utf8.flush()).text + seq.stops.flush()
            if tail and reason is not DoneReason.CANCEL:
                assert seq.sampler is not None
                job.events.put(Token(tail, seq.sampler.take_logprobs()))
        now = self.clock()
        slot.vacate(now)
        if self.pool is not None:
            self.pool.pressure = False  # cells came free: waiting jobs may try again
        self._transient = self._transient or job.grammar is not None
        seq.end(Done(seq.stats(reason, now)))

    def _fail(self, slot: Slot, error: CorralError) -> None:
        seq = slot.vacate(self.clock())
        if seq is not None:
            seq.end(Failed(error))
