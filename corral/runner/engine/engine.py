"""The engine: one llama.cpp context, its slots (KV streams, more of them as requests run
at once: runner.kv.growth), continuous batching and the prompt cache.

Exactly one thread (the engine thread) touches the model's context. Commands
arrive on one queue (runner.jobs: Submit, Embed, Stop, Resized, SetThreads); each
job's results leave on its own queue as Token events, then Done or Failed.

Each step reads schedule -> run (one llama_decode of the batch) -> postprocess:
  schedule     the placer (engine/placer.py) admits waiting sequences onto idle
               slots, each with its prefix from the slot's own cache, another slot or
               the prompt cache; context shifts; engine/batchplan.py chooses the next token
               of every decoding slot and prompt chunks of prefilling ones within n_batch;
               a KV pool that would overflow drops caches or preempts (engine/kvpool.py)
  postprocess  prompt chunks become cached, slots with logits sample and stream; then
               one slice of a waiting image goes through its own batch (engine/imagefeed.py)
Every batch and index is checked before native code, which aborts the whole process on misuse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import llama_cpp as L

from corral.errors import BadRequest, EngineFailed, RunnerError
from corral.runner.engine import admission, imagefeed, kvops, kvpool
from corral.runner.kv import kvbytes
from corral.runner.llama import native, sampling
from corral.runner.engine.batchplan import StepPlan, plan_step
from corral.runner.llama.context import EngineConfig, LlamaContext
from corral.runner.cache.caches import PrefixCaches, caches_for
from corral.runner.cache.diskread import Reader, read_entry, reads_for
from corral.runner.llama.embedding import EmbeddingContext, EmbedQueue
from corral.runner.kv.growth import Capacity, Resizer
from corral.runner.kv.reserve import Reserve
from corral.runner.wire import DoneLine
from corral.runner.jobs import (ClearCache, Done, Embed, Failed, Inbox, Job, PrefixRead, Resized,
                                SetThreads, Stop, Submit)
from corral.runner.engine.postprocess import Postprocess
from corral.runner.prefix import KVBytes
from corral.runner.engine.placer import Placement, Placer, Refusal, Source
from corral.runner.slots.sequence import DoneReason, Sequence, SeqState
from corral.runner.slots.slot import Slot, SlotState

log = logging.getLogger("corral.engine")

# An idle embedding context is freed after this long: a burst of embed calls
# reuses it, and a daemon that embeds once does not keep its buffers for good.
EMBED_KEEP = 10.0
TRIM_EVERY = 5.0  # seconds between heap trims while busy (one costs about a millisecond)


class Engine(Postprocess):
    def __init__(self, model_path: str, config: EngineConfig,
                 clock: Callable[[], float] = time.perf_counter,
                 llama: LlamaContext | None = None, load_seconds: float = 0.0,
                 step_hook: Callable[[StepPlan], None] | None = None,
                 disk_reader: Reader = read_entry, caches: PrefixCaches | None = None,
                 reserve_gate: threading.Event | None = None) -> None:
        if config.n_slots < 1 or config.n_slots > 256:
            raise BadRequest("slots must be between 1 and 256")
        self.config = config
        self.clock = clock
        self._commands = Inbox()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # A failed engine thread is final: `failed` is set, `failure` says why, every job
        # held or sent later ends with it, and the runner process exits (runner.process.main).
        self.failed = threading.Event()
        self.failure: EngineFailed | None = None
        self._step_hook = step_hook  # tests: makes a chosen step raise, as a bug would
        self.steps = self.sampled = 0  # decode steps; tokens sampled since load (a rate)
        self.step_time = 0.0  # seconds inside steps
        self.native_time = 0.0  # of which in llama_decode and samplers
        if llama is None:  # else loaded already, by runner/process/loading.py
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
        self._overwritten = 0  # warm prefixes placements overwrote since the last tick
        self.scratch = kvops.Scratch(llama.scratch)
        self.slots = [Slot(seq_id=i, num_ctx=self.num_ctx) for i in range(llama.streams)]
        # The cap's context is made ahead, uncommitted, where the KV is host memory (a
        # test's reserve_gate holds its build).
        reserve = Reserve(llama, config.n_slots, reserve_gate) \
            if not config.n_gpu_layers else None
        self.resizer = Resizer(llama, Capacity(llama.streams, config.n_slots),
                               self._commands.put, reserve) \
            if llama.streams < config.n_slots else None
        self.pool = kvpool.KVPool(self.n_ctx) if config.kv_pool else None
        self.caches = caches or caches_for(model_path, config)  # or a test's
        self.placer = Placer(self.num_ctx, self.caches, self.pool, reads_for(
            self.caches.disk, lambda: self._commands.put(PrefixRead()), disk_reader))
        self.embed_ctx = EmbeddingContext(self.model, self.num_ctx, self.n_threads, llama.adapters)
        self.feed = imagefeed.ImageFeed(self.ctx, self.n_batch, L.llama_model_n_embd_inp(self.model))

    # ---- public API, safe from any thread ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        self._refuse_if_stopped()
        if not job.prompt:
            raise BadRequest("empty prompt")
        imagefeed.check_images(job, self.n_vocab, self.n_batch)
        job.submitted = self.clock()
        self._commands.put(Submit(job))
        return job

    def _refuse_if_stopped(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._stopping:
            raise RunnerError("engine is shutting down")

    def run_embed(self, command: Embed) -> list[list[float]]:
        """Embed and wait; `command.cancel()` from another thread stops it between slices."""
        self._commands.put(command)
        result = command.reply.get()
        if isinstance(result, Failed):
            raise result.error
        return result

    def running(self) -> bool:
        """The engine thread is alive (false before start and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def set_threads(self, n: int) -> None:
        self._commands.put(SetThreads(max(1, min(n, 1024))))

    def status(self) -> dict[str, int]:
        slots = self.slots
        return {
            "slots": len(slots), "slots_cap": self.config.n_slots, "threads": self.n_threads,
            "busy_slots": sum(s.state is not SlotState.IDLE for s in slots),
            "waiting": self.placer.queued() + len(self._embeds.pending)
            + self._commands.qsize(),
            "kv_used": sum(s.n_past for s in slots), "kv_reserved": self.n_ctx,
            "preemptions": self.pool.preemptions if self.pool is not None else 0,
            "sampled": self.sampled, **self.caches.describe(),
            "reserve_streams": self.resizer.reserve_streams() if self.resizer else 0}

    def kv_held(self, kv_cap: int) -> int:
        """Bytes of KV committed now, `kv_cap` being the load's estimate of it at the cap:
        the serving context's share of that, by cells, less what the reserve left
        uncommitted (runner.kv.growth)."""
        cells = self.config.kv_pool or self.num_ctx * self.config.n_slots
        current = min(kv_cap * self.llama.n_ctx // max(cells, 1), kv_cap)
        return self.resizer.kv_held(current) if self.resizer is not None else current

    def clear_cache(self) -> None:
        """Drop the prompt cache's RAM (memory is wanted for another model)."""
        self._commands.put(ClearCache())

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
                # Housekeeping before waiting for work: the first moment at rest is used,
                # however short (a client that sends its next request at once still
                # leaves one between two of them), so the reserve is made before a burst.
                idle = self._idle()
                self._housekeep(idle)
                self._drain(block=idle)
                if self._stopping:
                    break
                if self._embeds:
                    self._embeds.step(self.embed_ctx)
                    self._embedded_at, self._transient = self.clock(), True
                plan = self._schedule()
                if plan is not None:
                    if self._step_hook is not None:
                        self._step_hook(plan)
                    t0 = self.clock()
                    self._postprocess(plan, self._run_batch(plan))
                    self.step_time += self.clock() - t0
                    self.steps += 1
        except Exception as exc:  # a bug here must not leave any client hanging
            log.exception("engine thread failed")
            self.failure = EngineFailed(f"the model's engine failed: {exc}")
            self._stopping = True
        finally:
            error = self.failure or RunnerError("runner is shutting down")
            self._fail_everyone(error)
            self._commands.close(error)
            if self.failure is not None:
                self.failed.set()  # the runner process exits; the daemon loads afresh

    def _idle(self) -> bool:
        return not self.placer.waiting and not self._embeds and all(
            s.state is SlotState.IDLE for s in self.slots)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5 if block else 0.0)
        except queue.Empty:
            return
        while True:
            if isinstance(item, Submit):
                self.placer.add(Sequence(item.job))
            elif isinstance(item, Embed):
                self._embeds.add(item)
            elif isinstance(item, Stop):
                self._stopping = True
            elif isinstance(item, Resized):
                self._resized(item)
            elif isinstance(item, SetThreads):  # the daemon's share of the cores
                self.n_threads = self.llama.set_threads(item.n)
                self.embed_ctx.set_threads(item.n)
            elif isinstance(item, ClearCache):
                self._transient = self._transient or self.caches.ram.clear() > 0
            try:
                item = self._commands.get()
            except queue.Empty:
                return

    def _resized(self, resized: Resized) -> None:
        """A bigger or smaller context arrived: move every sequence onto it."""
        assert self.resizer is not None
        slots = self.resizer.apply(resized, self.slots, self.num_ctx, self.clock(),
                                   lambda s: kvops.save(self.ctx, s, self.caches))
        if slots is not None:
            self.slots = slots
            self.ctx, self.mem, self.n_ctx = self.llama.ctx, self.llama.mem, self.llama.n_ctx
            self.feed.ctx = self.ctx
            self.scratch.moved(self.llama.scratch)

    def _housekeep(self, idle: bool) -> None:
        """Give back what bursts took, so memory returns to what `ps` reports: when idle,
        and every few seconds under load, when the engine may never be idle."""
        # runner.kv.reserve: made on a builder thread after the first rest; its pages are
        # looked at here, at rest, in pieces, until a command arrives.
        if idle and self.resizer is not None:
            self.resizer.rest(self.sampled > 0, lambda: self._commands.qsize() > 0)
        now = self.clock()
        if idle and self.embed_ctx.ctx is not None and now - self._embedded_at > EMBED_KEEP:
            self.embed_ctx.free()
            self._transient = True
        if self._transient and (idle or now - self._trimmed_at > TRIM_EVERY):
            native.release_free_memory()
            self._transient, self._trimmed_at = False, now

    def _reap_cancelled(self) -> None:
        # A queued request whose client has gone is dropped without running.
        waiting = self.placer.waiting
        for seq in [s for s in waiting if s.job.cancelled.is_set()]:
            waiting.remove(seq)
            seq.end(Done(DoneLine(done_reason=DoneReason.CANCEL.value)))
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                self._finish(slot, DoneReason.CANCEL)

    def _admit(self) -> None:
        donors: dict[tuple[int, int], KVBytes] = {}  # states read from donor slots this round
        while (decision := self.placer.next(self.slots)) is not None:
            if isinstance(decision, Refusal):
                decision.seq.end(Failed(decision.error))
                continue
            try:
                self._place(decision, donors)
            except BadRequest as exc:
                decision.seq.end(Failed(exc))

    def _place(self, p: Placement, donors: dict[tuple[int, int], KVBytes]) -> None:
        """Start (or resume) a sequence on its slot, with the prefix the placer chose."""
        seq, job, tokens = p.seq, p.seq.job, p.tokens
        resuming = seq.state is SeqState.PREEMPTED
        if not resuming:
            job.prompt = tokens
        eog = self.llama.eog_tokens() if job.ignore_eos else None
        sampler = None if resuming else sampling.for_job(  # a bad grammar: its 400 alone
            job, tokens, self.vocab, self.n_vocab, self.num_ctx, eog)
        slot, reused = p.slot, p.n_prefix if p.source is Source.REUSE else 0
        streams = 1 if self.pool is not None else len(self.slots)
        if self.resizer is not None and self.resizer.capacity.warm(
                len(slot.cached) - reused, slot.last_used, self.clock()):
            self._overwritten += 1  # another conversation's prefix goes: want a stream more
        n_prefix = kvops.load_prefix(self.ctx, self.mem, p, self.caches, streams,
                                     [s.reusable() for s in self.slots if s is not slot],
                                     donors, self.can_shift, self.scratch)
        p.slot.assign(seq, tokens[:n_prefix], shifted=slot.tainted and (
            n_prefix > 0 or slot.join_at >= 0) and p.source in (Source.NONE, Source.REUSE))
        if sampler is None:
            seq.resume(tokens, n_prefix)
        else:
            limit = admission.generation_limit(job, len(tokens), self.num_ctx)
            seq.start(sampler, limit, tokens, n_prefix, self.clock())

    # ---- one step ----------------------------------------------------------------------

    def _schedule(self) -> StepPlan | None:
        """Admit what can start, then plan the batch; None when no slot is busy."""
        self._reap_cancelled()
        self.scratch.release(self.mem)
        self._admit()
        active = sum(s.state is not SlotState.IDLE for s in self.slots)
        if self.resizer is not None:
            now, capacity = self.clock(), self.resizer.capacity
            warm = active + self._overwritten + sum(
                capacity.warm(len(s.cached), s.last_used, now)
                for s in self.slots if s.state is SlotState.IDLE)
            self._overwritten = 0
            self.resizer.tick(active, len(self.placer.waiting), now, warm)
        if not active:
            return None
        for slot in self.slots:
            if slot.state is SlotState.DECODE and slot.n_past >= self.num_ctx:
                if not kvops.shift_context(self.mem, slot, self.can_shift):
                    self._finish(slot, DoneReason.LENGTH)
        plan = plan_step(self.slots, self.n_batch)
        if self.pool is not None:  # make the pool hold this step: drop caches, then preempt
            plan = self.pool.fit(plan, self.slots, self._drop, self._preempt,
                                 lambda: plan_step(self.slots, self.n_batch))
        return plan

    def _run_batch(self, plan: StepPlan) -> int:
        if not plan.rows:
            return 0
        native.fill_batch(self.batch, plan.rows, self.n_batch)
        t0 = self.clock()
        rc = int(L.llama_decode(self.ctx, self.batch))
        self.native_time += self.clock() - t0
        return rc

    def _postprocess(self, plan: StepPlan, rc: int) -> None:
        if rc != 0:
            self._decode_failed(rc, plan.slots)
        elif plan.rows:
            self._apply(plan)
            self.scratch.join(self.mem, [slot for slot, _ in plan.prefill])
        self._feed_image()

    def _drop(self, slot: Slot) -> None:
        """An idle slot's cache goes for room in the pool: to the prompt cache first."""
        kvops.save(self.ctx, slot, self.caches)
        kvops.drop(self.mem, slot)

    def _preempt(self, slot: Slot) -> None:
        assert self.pool is not None
        kvops.drop(self.mem, slot)
        seq = slot.vacate(self.clock())
        self.scratch.release(self.mem)
        assert seq is not None
        seq.preempt()  # it keeps its sampler, streams and tokens: nothing is copied
        self.placer.requeue(seq)
        self.pool.preemptions += 1
        self.pool.pressure = True
        log.debug("preempted a sequence after %d tokens", seq.n_generated)

    def _decode_failed(self, rc: int, slots: list[Slot]) -> None:
        log.error("llama_decode returned %d", rc)
        if not kvops.recover(self.mem, rc, slots, self.slots):
            for slot in slots:
                self._fail(slot, RunnerError(f"llama_decode failed ({rc})"))

    def _fail_everyone(self, error: RunnerError) -> None:
        for slot in self.slots:
            if slot.sequence is not None:
                self._fail(slot, error)
        for seq in self.placer.take_all():  # waiting, or waiting for a disk read
            seq.end(Failed(error))
        self._embeds.fail_all(error)

    def _free(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # still inside native code; the process exit will reclaim it
        if self.caches.disk is not None:  # what the idle slots and RAM hold outlives us
            states = [(s.reusable(), kvbytes.get(self.ctx, s.seq_id)) for s in self.slots
                      if s.state is SlotState.IDLE and self.caches.wanted(s.reusable())]
            self.caches.flush([(t, d) for t, d in states if d is not None])
        self.embed_ctx.free()
        self.feed.free()
        if self.resizer is not None:
            self.resizer.free()
        self.llama.free()
