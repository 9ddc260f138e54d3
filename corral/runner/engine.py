"""The engine: one llama.cpp context, fixed slots, continuous batching.

Exactly one thread (the engine thread) touches the model's context. Commands
arrive on one queue (runner.jobs: Submit, Embed, Stop); each job's results
leave on its own queue as Token events, then Done or Failed.

Each step is plan -> decode -> apply: runner.batchplan chooses the next token
of every decoding slot and prompt chunks of prefilling slots within the
n_batch budget, one llama_decode runs them, and the results advance each
slot's state machine; then one slice of a waiting image goes through its own
embeddings batch (runner.imagefeed). Every batch and index is checked before it
reaches native code: llama.cpp aborts the whole process on misuse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

import llama_cpp as L

from corral.errors import BadRequest, CorralError, RunnerError
from corral.runner import imagefeed, kvops, native
from corral.runner.admission import fit_prompt, generation_limit
from corral.runner.batchplan import StepPlan, plan_step
from corral.runner.context import EngineConfig, LlamaContext
from corral.runner.embedding import Embedder, EmbedQueue
from corral.runner.imagefeed import ImageFeed
from corral.runner.growth import Capacity, Resizer
from corral.runner.jobs import (Command, Done, Embed, Failed, Job, Resized, SetThreads, Stop,
                                Submit, Token)
from corral.runner.sampling import for_job
from corral.runner.kvpool import KVPool
from corral.runner.sequence import DoneReason, Sequence, SeqState
from corral.runner.slot import Slot, SlotState, common_prefix

log = logging.getLogger("corral.engine")

# An idle embedding context is freed after this long: a burst of embed calls
# reuses it, and a daemon that embeds once does not keep its buffers for good.
EMBED_KEEP = 10.0
TRIM_EVERY = 5.0  # seconds between heap trims while busy (one costs about a millisecond)


class Engine:
    def __init__(self, model_path: str, config: EngineConfig,
                 clock: Callable[[], float] = time.perf_counter,
                 llama: LlamaContext | None = None, load_seconds: float = 0.0) -> None:
        if config.n_slots < 1 or config.n_slots > 256:
            raise BadRequest("slots must be between 1 and 256")
        self.config = config
        self.clock = clock
        self._commands: queue.Queue[Command] = queue.Queue()
        self._waiting: deque[Sequence] = deque()  # new and preempted, oldest first
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = self.sampled = 0  # decode steps; tokens sampled since load (a rate)
        self.step_time = 0.0  # seconds inside _step
        self.native_time = 0.0  # of which in llama_decode and samplers
        if llama is None:  # else loaded already, by runner/loading.py
            native.init_backend(deterministic=config.deterministic)
            t0 = clock()
            llama = LlamaContext(model_path, config)
            load_seconds = clock() - t0
        self.llama, self.load_seconds = llama, load_seconds
        self.model, self.vocab, self.ctx, self.mem = llama.model, llama.vocab, llama.ctx, llama.mem
        self.batch, self.n_batch, self.n_ctx, self.num_ctx = (llama.batch, llama.n_batch,
                                                              llama.n_ctx, llama.num_ctx)
        self.n_vocab, self.n_ctx_train, self.n_threads = (llama.n_vocab, llama.n_ctx_train,
                                                          llama.n_threads)
        self.can_shift, self.add_bos = llama.can_shift, llama.add_bos
        self.tokenize, self.detokenize = llama.tokenize, llama.detokenize  # any thread
        self._embedded_at = self._trimmed_at = 0.0
        self._embeds = EmbedQueue()
        self._transient = False  # freed native memory waits to be handed back when idle
        self.slots = [Slot(seq=i, num_ctx=self.num_ctx) for i in range(llama.streams)]
        self.resizer = Resizer(llama, Capacity(llama.streams, config.n_slots),
                               self._commands.put) if llama.streams < config.n_slots else None
        self.pool = KVPool(self.n_ctx) if config.kv_pool else None
        self.embedder = Embedder(self.model, self.num_ctx, self.n_threads, llama.adapters)
        self.feed = ImageFeed(self.ctx, self.n_batch, L.llama_model_n_embd_inp(self.model))

    # ---- public API, safe from any thread ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        if self._stopping:
            raise RunnerError("engine is shutting down")
        if not job.prompt:
            raise BadRequest("empty prompt")
        imagefeed.check_images(job, self.n_vocab, self.n_batch)
        job.submitted = self.clock()
        self._commands.put(Submit(job))
        return job

    def embed(self, inputs: list[list[int]], truncate: bool = True) -> list[list[float]]:
        return self.run_embed(Embed(inputs, truncate))

    def run_embed(self, command: Embed) -> list[list[float]]:
        """Embed and wait; `command.cancel()` from another thread stops it between slices."""
        self._commands.put(command)
        result = command.reply.get()
        if isinstance(result, Failed):
            raise result.error
        return result

    def set_threads(self, n: int) -> None:
        self._commands.put(SetThreads(max(1, min(n, 1024))))

    def status(self) -> dict[str, int]:
        slots = self.slots
        return {
            "slots": len(slots), "slots_cap": self.config.n_slots, "threads": self.n_threads,
            "busy_slots": sum(s.state is not SlotState.IDLE for s in slots),
            "waiting": len(self._waiting) + len(self._embeds.pending) + self._commands.qsize(),
            "kv_used": sum(s.n_past for s in slots), "kv_reserved": self.n_ctx,
            "preemptions": self.pool.preemptions if self.pool is not None else 0,
            "sampled": self.sampled}

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._free()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = any(s.state is not SlotState.IDLE for s in self.slots) or bool(
                    self._embeds)
                self._drain(block=not busy and not self._waiting)
                if self._stopping:
                    break
                self._housekeep(idle=not busy and not self._waiting)
                self._reap_cancelled()
                if self._embeds:
                    self._embeds.step(self.embedder)
                    self._embedded_at, self._transient = self.clock(), True
                self._admit()
                active = sum(s.state is not SlotState.IDLE for s in self.slots)
                if self.resizer is not None:
                    self.resizer.tick(active, len(self._waiting), self.clock())
                if active:
                    t0 = self.clock()
                    self._step()
                    self.step_time += self.clock() - t0
                    self.steps += 1
        except Exception as exc:  # a bug here must not leave clients hanging
            log.exception("engine thread failed")
            self._fail_everyone(f"engine failed: {exc}")
        finally:
            self._fail_everyone("runner is shutting down")

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Submit):
                self._waiting.append(Sequence(item.job))
            elif isinstance(item, Embed):
                self._embeds.add(item)
            elif isinstance(item, Stop):
                self._stopping = True
            elif isinstance(item, Resized):
                self._resized(item)
            elif isinstance(item, SetThreads):  # the daemon's share of the cores
                self.n_threads = self.llama.set_threads(item.n)
                self.embedder.set_threads(item.n)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _resized(self, resized: Resized) -> None:
        """A bigger or smaller context arrived: move every sequence onto it."""
        assert self.resizer is not None
        slots = self.resizer.apply(resized, self.slots, self.num_ctx, self.clock())
        if slots is not None:
            self.slots = slots
            self.ctx, self.mem, self.n_ctx = self.llama.ctx, self.llama.mem, self.llama.n_ctx
            self.feed.ctx = self.ctx

    def _housekeep(self, idle: bool) -> None:
        """Give back what bursts took, so memory returns to what `ps` reports: when idle,
        and every few seconds under load, when the engine may never be idle."""
        now = self.clock()
        if idle and self.embedder.ctx is not None and now - self._embedded_at > EMBED_KEEP:
            self.embedder.free()
            self._transient = True
        if self._transient and (idle or now - self._trimmed_at > TRIM_EVERY):
            native.release_free_memory()
            self._transient, self._trimmed_at = False, now

    def _reap_cancelled(self) -> None:
        # A queued request whose client has gone is dropped without running.
        for seq in [s for s in self._waiting if s.job.cancelled.is_set()]:
            self._waiting.remove(seq)
            seq.end(Done({"done_reason": DoneReason.CANCEL.value}))
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                self._finish(slot, DoneReason.CANCEL)

    def _admit(self) -> None:
        while self._waiting:
            idle = [s for s in self.slots if s.state is SlotState.IDLE]
            if not idle:
                return
            seq = self._waiting[0]  # oldest first; a preempted one is back at the front
            if self.pool is not None and not self.pool.admits(self.slots, self._need(seq)):
                return  # no room in the pool yet: it and everything behind it wait
            self._waiting.popleft()
            try:
                self._place(seq, idle)
            except BadRequest as exc:
                seq.end(Failed(exc))

    def _need(self, seq: Sequence) -> int:
        return min(len(seq.job.prompt) + len(seq.generated), self.num_ctx)

    def _place(self, seq: Sequence, idle: list[Slot]) -> None:
        """Put a waiting sequence on the idle slot that caches most of its tokens."""
        job, resuming = seq.job, seq.state is SeqState.PREEMPTED
        tokens = fit_prompt(job, seq.generated if resuming else [], self.num_ctx)
        if not resuming:
            job.prompt = tokens
        # The idle slot sharing the longest prefix wins; ties go to the least recently used.
        keep, _, slot = max(((common_prefix(s.reusable(), tokens), -s.last_used, s)
                             for s in idle), key=lambda c: (c[0], c[1]))
        # At least one prompt token must be decoded to get logits.
        keep = imagefeed.align_keep(job.images, min(keep, len(tokens) - 1))
        eog = self.llama.eog_tokens() if job.ignore_eos else None
        # A new sequence's sampler first: a grammar that does not parse is its 400.
        sampler = None if resuming else for_job(job, tokens, self.vocab, self.n_vocab,
                                                self.num_ctx, eog)
        if keep == 0 or not L.llama_memory_seq_rm(self.mem, slot.seq, keep, -1):
            L.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            keep = 0
        slot.assign(seq, keep)
        if sampler is None:
            seq.resume(tokens, keep)
        else:
            seq.start(sampler, generation_limit(job, len(tokens), self.num_ctx), tokens, keep,
                      self.clock())

    # ---- one step ----------------------------------------------------------------------

    def _step(self) -> None:
        for slot in self.slots:
            if slot.state is SlotState.DECODE and slot.n_past >= self.num_ctx:
                if not kvops.shift_context(self.mem, slot, self.can_shift):
                    self._finish(slot, DoneReason.LENGTH)
        plan = plan_step(self.slots, self.n_batch)
        if self.pool is not None:  # make the pool hold this step: drop caches, then preempt
            plan = self.pool.fit(plan, self.slots, lambda s: kvops.drop(self.mem, s),
                                 self._preempt, lambda: plan_step(self.slots, self.n_batch))
        if plan.entries:
            native.fill_batch(self.batch, plan.entries, self.n_batch)
            t0 = self.clock()
            rc = L.llama_decode(self.ctx, self.batch)
            self.native_time += self.clock() - t0
            if rc != 0:
                self._decode_failed(rc, plan.slots)
            else:
                self._apply(plan)
        self._feed_image()

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
                self._sample(slot, plan.sample_at[slot.seq])
        for slot in plan.decoding:
            if slot.state is SlotState.DECODE:
                slot.cached.append(slot.last_token)
                self._sample(slot, plan.sample_at[slot.seq])

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

    def _preempt(self, slot: Slot) -> None:
        assert self.pool is not None
        kvops.drop(self.mem, slot)
        seq = slot.vacate(self.clock())
        assert seq is not None
        seq.preempt()  # it keeps its sampler, streams and tokens: nothing is copied
        self._waiting.appendleft(seq)
        self.pool.preemptions += 1
        self.pool.pressure = True
        log.debug("preempted a sequence after %d tokens", seq.n_generated)

    def _decode_failed(self, rc: int, slots: list[Slot]) -> None:
        log.error("llama_decode returned %d", rc)
        if not kvops.recover(self.mem, rc, slots, self.slots):
            for slot in slots:
                self._fail(slot, RunnerError(f"llama_decode failed ({rc})"))

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

    def _fail_everyone(self, message: str) -> None:
        error = RunnerError(message)
        for slot in self.slots:
            if slot.sequence is not None:
                self._fail(slot, error)
        for seq in self._waiting:
            seq.end(Failed(error))
        self._waiting.clear()
        self._embeds.fail_all(error)

    def _free(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # still inside native code; the process exit will reclaim it
        self.embedder.free()
        self.feed.free()
        self.llama.free()
