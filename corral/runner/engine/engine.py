"""The engine: one llama.cpp context, its slots (one shared KV buffer by default, whose
pages follow the cells written: runner.kv.settle; or a KV stream each, more of them as
requests run at once: runner.kv.growth), continuous batching and the prompt cache.

Exactly one thread (the engine thread) touches the model's context. Commands
arrive on one queue (runner.jobs: Submit, Embed, Stop, Resized, SetThreads); each
job's results leave on its own queue as Token events, then Done or Failed.

Each step reads schedule -> run -> postprocess, and its plan is data (engine/plan.py):
  schedule     decides, without llama.cpp (engine/schedule.py): cancelled requests end,
               the placer (engine/placer.py) admits waiting sequences onto idle slots with
               the KV ops that bring their prefix (engine/kvplan.py), context shifts,
               engine/batchplan.py chooses the batch, a KV pool that would overflow drops
               caches or preempts (engine/kvpool.py), one slice of a waiting image is chosen
  run          makes every native call (engine/run.py): the ops in order (engine/kvops.py),
               new sequences' samplers, one llama_decode of the batch
  postprocess  ends what schedule ended; prompt chunks become cached, slots with logits
               sample and stream (engine/postprocess.py)
then the image slice, if any, is a second run and postprocess of the same plan: a decode
overwrites the logits of the one before, so the batch is sampled first. Then speculation
decides and makes the next step's drafts (runner.speculative.speculation): from the
n-gram index, or from a draft model (a Modelfile's DRAFT), whose context this thread
owns too.
After it, elastic KV's policy hears the step's demand (runner.kv.growth); between steps,
engine/housekeeping.py gives back what a burst took. Every batch and index is checked
before native code, which aborts the whole process on misuse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from corral.errors import BadRequest, EngineFailed, RunnerError
from corral.runner.cache.caches import PrefixCaches, caches_for
from corral.runner.cache.diskread import Reader, read_entry, reads_for
from corral.runner.engine import imagefeed
from corral.runner.engine.housekeeping import Housekeeping
from corral.runner.engine.kvpool import KVPool
from corral.runner.engine.placer import Placer
from corral.runner.engine.plan import StepPlan
from corral.runner.engine.postprocess import Postprocess
from corral.runner.engine.run import Outcome, Run
from corral.runner.engine.schedule import Schedule
from corral.runner.watch import StepWatch
from corral.runner.jobs import (ClearCache, Embed, Failed, Inbox, Job, PrefixRead, Resized,
                                SetThreads, Stop, Submit)
from corral.runner.kv import kvbytes
from corral.runner.kv.growth import Capacity, Resizer
from corral.runner.kv.reserve import Reserve, possible as reserve_possible
from corral.runner.kv.settle import Settler
from corral.runner.llama import native
from corral.runner.llama.context import EngineConfig, LlamaContext
from corral.runner.llama.embedding import EmbeddingContext, EmbedQueue
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot, SlotState
from corral.runner.speculative.cost import StepCost
from corral.runner.speculative.source import DraftSource
from corral.runner.speculative.speculation import speculation

log = logging.getLogger("corral.engine")



class Engine:
    def __init__(self, model_path: str, config: EngineConfig,
                 clock: Callable[[], float] = time.perf_counter,
                 llama: LlamaContext | None = None, load_seconds: float = 0.0,
                 step_hook: Callable[[StepPlan], None] | None = None,
                 disk_reader: Reader = read_entry, caches: PrefixCaches | None = None,
                 reserve_gate: threading.Event | None = None,
                 drafts: DraftSource | None = None, cost: StepCost | None = None) -> None:
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
        self._step_hook = step_hook  # tests: makes a chosen step raise (or block), as a bug would
        self.watch = StepWatch()  # how long the step now running has run (runner.process.main)
        self.steps = self.sampled = 0  # decode steps; tokens sampled since load (a rate)
        self.step_time = 0.0  # seconds inside steps
        self.native_time = 0.0  # of which in llama_decode and samplers
        if llama is None:  # else loaded already, by runner/process/loading.py
            native.init_backend(deterministic=config.deterministic)
            t0 = clock()
            llama = LlamaContext(model_path, config)
            load_seconds = clock() - t0
        # The context's fields have one owner: `llama`, which a resize updates.
        self.llama, self.load_seconds = llama, load_seconds
        self._embeds = EmbedQueue()
        self.slots = [Slot(seq_id=i, num_ctx=llama.num_ctx) for i in range(llama.streams)]
        # The cap's context is made ahead, uncommitted, where the KV is host memory and
        # ggml's clear hands pages back (a test's reserve_gate holds its build).
        reserve = Reserve(llama, config.n_slots, reserve_gate) \
            if not config.n_gpu_layers and reserve_possible() else None
        self.resizer = Resizer(llama, Capacity(llama.streams, config.n_slots),
                               self._commands.put, reserve) \
            if llama.streams < config.n_slots else None
        self.pool = KVPool(llama.n_ctx) if config.kv_pool else None
        self.caches = caches or caches_for(model_path, config)  # or a test's
        self.placer = Placer(llama.num_ctx, self.caches, self.pool, reads_for(
            self.caches.disk, lambda: self._commands.put(PrefixRead()), disk_reader),
            llama.cuts)
        # None where off, or where the memory cannot take back a rejected draft's cells
        # (recurrent state without llama.cpp's snapshots): `speculation` says the rest.
        self.spec = speculation(config.speculative and llama.can_rollback, drafts,
                                llama.undo, cost)
        self.schedule = Schedule(self.placer, self.caches, self.pool, llama.num_ctx,
                                 llama.n_batch, llama.can_shift, clock,
                                 self.resizer.capacity if self.resizer is not None else None,
                                 llama.scratch, self.spec, llama.cuts, llama.is_control)
        self.run = Run(llama, self.caches, self.pool is not None, clock, self.spec)
        self.post = Postprocess(llama, self.run.feed, self.placer, self.pool, clock, self.spec)
        self.embed_ctx = EmbeddingContext(llama.model, llama.num_ctx, llama.n_threads,
                                          llama.adapters, alone=config.deterministic)
        self.settler = Settler(llama) if self.pool is not None else None
        self.housekeeping = Housekeeping(self.embed_ctx, self.resizer, self.settler, self.watch,
                                         lambda: self.placer.queued() + self._commands.qsize(),
                                         self.run.redo, self.run.presave)

    # ---- public API, safe from any thread ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        self._refuse_if_stopped()
        if not job.prompt:
            raise BadRequest("empty prompt")
        imagefeed.check_images(job, self.llama.n_vocab, self.llama.n_batch)
        if job.ignore_eos:  # its vocabulary-wide scan (0.1 s for gemma3) here, not in a step
            self.llama.eog_tokens()
        job.submitted = self.clock()
        self._commands.put(Submit(job))
        return job

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.llama.tokenize(text, add_special)  # the vocabulary alone: any thread

    def detokenize(self, tokens: list[int]) -> str:
        return self.llama.detokenize(tokens)

    def _refuse_if_stopped(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._stopping:
            raise RunnerError("engine is shutting down")

    def run_embed(self, command: Embed) -> list[list[float]]:
        """Embed and wait; `command.cancel()` from another thread stops it between slices."""
        self._commands.put(command)
        while True:  # a stalled engine never answers: its failure does
            try:
                result = command.reply.get(timeout=1.0)
                break
            except queue.Empty:
                if self.failure is not None or (self._thread is not None and not self.running()):
                    raise self.failure or RunnerError("the engine has stopped") from None
        if isinstance(result, Failed):
            raise result.error
        return result

    def stall(self, seconds: float, bound: float, first: Callable[[EngineFailed], None]
              | None = None, what: str = "one step") -> None:
        """The watchdog's word (runner.process.main): `what` (a step, a media encode) has
        run for `seconds`, past `bound`, in native code that does not return. As final as
        a failure: every job held or sent later ends with it (`first` ends the held ones
        before anyone is told), and the process exits: nothing can stop the thread."""
        if self.failure is None:
            self.failure = EngineFailed(
                f"the model's engine stalled: {what} has run for {seconds:.0f} s, past "
                f"the {bound:g} s bound (CORRAL_STEP_TIMEOUT), inside llama.cpp (a stopped "
                "RPC worker or a hung device); the runner is being replaced")
            log.error("%s", self.failure)
        self._stopping = True
        self._commands.close(self.failure)
        if first is not None:
            first(self.failure)
        self.failed.set()

    def running(self) -> bool:
        """The engine thread is alive (false before start and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def set_threads(self, n: int) -> None:
        self._commands.put(SetThreads(max(1, min(n, 1024))))

    def status(self) -> dict[str, int]:
        slots = self.slots
        return {
            "slots": len(slots), "slots_cap": self.config.n_slots,
            "threads": self.llama.n_threads,
            "busy_slots": sum(s.state is not SlotState.IDLE for s in slots),
            "waiting": self.placer.queued() + len(self._embeds.pending)
            + self._commands.qsize(),
            "kv_used": sum(s.n_past for s in slots), "kv_reserved": self.llama.n_ctx,
            "preemptions": self.pool.preemptions if self.pool is not None else 0,
            "sampled": self.sampled, **self.caches.describe(),
            "reserve_streams": self.resizer.reserve_streams() if self.resizer else 0,
            "index_bytes": self.spec.bytes() if self.spec is not None else 0}

    def kv_held(self, kv_cap: int) -> int:
        """Bytes of KV committed now, `kv_cap` being the load's estimate of it at the cap:
        the serving context's KV pages in memory (the cells written), or where ggml's
        clear committed them all, its share of the estimate by cells; the reserve's
        (runner.kv.growth); and the slots' checkpoints (host memory, read as prompts ran)."""
        ctx = self.llama.ctx  # read once: the engine thread may move to another meanwhile
        current = self.llama.kv_committed(ctx)
        if current is None:
            cells = self.config.kv_pool or self.llama.num_ctx * self.config.n_slots
            current = min(kv_cap * self.llama.n_ctx // max(cells, 1), kv_cap)
        held = self.resizer.kv_held(current, ctx) if self.resizer is not None else current
        return held + sum(slot.checkpoint_bytes() for slot in list(self.slots))

    def clear_cache(self) -> None:
        """Drop the prompt cache's RAM (memory is wanted for another model)."""
        self._commands.put(ClearCache())

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(Stop())
        if self._thread is not None:  # a stalled thread never returns: no wait for it
            self._thread.join(timeout=0 if self.watch.running_for() and self.failed.is_set()
                              else 30)
        self._free()

    # ---- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                # Housekeeping before waiting for work: the first moment at rest is used,
                # however short (a client that sends its next request at once still
                # leaves one between two of them), so the reserve is made before a burst;
                # what no request waits for is due a little later, and the wait ends then.
                idle = self._idle()
                self.housekeeping.rest(idle, self.clock(), self.slots, self.sampled > 0,
                                       self.run.save, self.steps)
                self._drain(self.housekeeping.wait(self.clock()) if idle else 0.0)
                if self._stopping:
                    break
                if idle and self.housekeeping.owing:  # what came waits for the owed token
                    continue
                self.watch.enter()
                try:
                    if self._embeds:
                        self._embeds.step(self.embed_ctx)
                        self.housekeeping.freed(self.clock())
                    self._step()
                finally:  # the grace lasts until a decode has paged the weights in
                    self.watch.leave(worked=self.steps > 0 or self.embed_ctx.decodes > 0)
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

    def _step(self) -> None:
        """schedule -> run -> postprocess (and run again for the cells of drafts postprocess
        rejected; then the image slice); speculation makes the next step's drafts and
        prices this one's rows; then elastic KV hears the demand."""
        plan = self.schedule.plan(self.slots)
        self.post.ends(plan)
        if plan.busy:
            if self._step_hook is not None:
                self._step_hook(plan)
            t0 = self.clock()
            out = self.run.step(plan, self.slots)
            self.post.step(plan, out)
            self._stuck(self.run.trim(self.post.cut_back()))
            rows_time = self.clock() - t0  # the decode, and the samplers of its rows
            self.native_time += out.native
            if plan.image is not None and out.ok \
                    and plan.image.slot.seq_id not in out.skipped():  # after the batch: run.py
                image = self.run.image(plan.image, self.slots)
                self.post.image(plan.image, image)
                self.native_time += image.native
            if self.spec is not None:
                self._speculate(out, rows_time)
            self.step_time += self.clock() - t0
            self.steps += 1
        elif plan.ops:  # nothing decodes, but what ended may hold cells: they go now
            self.run.ops(plan)
        changes = self.post.take()
        self.native_time += changes.native
        self.sampled += changes.sampled
        if changes.freed:
            self.housekeeping.freed()
        if self.resizer is not None and plan.demand is not None:  # may start a builder thread
            demand = plan.demand
            self.resizer.tick(demand.busy, demand.waiting, demand.now, demand.warm)

    def _speculate(self, out: Outcome, seconds: float) -> None:
        """The next step's drafts, made now for the sequences it will decode (a draft
        model decodes here, on this thread); a step that only decoded prices its rows
        (every one has logits) by what it took, `seconds`: its decode and the sampling
        and verifying of each row, which llama_decode's time leaves out (on the base
        starter's 262k-token vocabulary, sixteen streams: 107 ms in llama_decode, 114
        in all; with eight draft rows beside them, 138 and 150)."""
        assert self.spec is not None
        if out.ok and out.batch.decoding and not out.batch.prefill:  # in this step's layout
            self.spec.observe([row.seq_id for row in out.batch.rows], seconds)
        self.spec.prepare(self.schedule.ask(self.slots))

    def _stuck(self, seq_ids: set[int]) -> None:
        """Slots whose cells taken back (a rejected draft's, a prompt's last token) would
        not go (run dropped all their cells): their next token would sit beside those, so
        their requests fail, and they hold nothing."""
        for slot in [s for s in self.slots if s.seq_id in seq_ids]:
            slot.cached, slot.tainted, slot.checkpoints = [], False, []
            if slot.sequence is not None:  # else it ended this step: already IDLE
                self.post.fail(slot, RunnerError("cells taken back (a rejected draft's) "
                                                 "could not be removed"))

    def _idle(self) -> bool:
        """Nothing to do: no request waits or runs, and no parked run waits for its Drop
        (its owner failed in postprocess: the next plan frees its cells)."""
        return not self.placer.waiting and not self._embeds and all(
            s.state is SlotState.IDLE for s in self.slots) and not self.schedule.parking.pending()

    def _drain(self, wait: float) -> None:
        try:
            item = self._commands.get(timeout=wait)
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
                self.llama.set_threads(item.n)
                self.embed_ctx.set_threads(item.n)
                if self.spec is not None:
                    self.spec.set_threads(item.n)
            elif isinstance(item, ClearCache):
                if self.caches.ram.clear() > 0:
                    self.housekeeping.freed()
            try:
                item = self._commands.get()
            except queue.Empty:
                return

    def _resized(self, resized: Resized) -> None:
        """A bigger or smaller context arrived: move every sequence onto it (the context's
        fields follow in `llama`; the slots are the engine's), watched as a step is."""
        assert self.resizer is not None
        self.watch.enter("a resize's copy of the sequences")
        try:
            slots = self.resizer.apply(resized, self.slots, self.llama.num_ctx, self.clock(),
                                       self.run.save)
        finally:
            self.watch.leave(worked=False)
        if slots is not None:
            self.slots = slots
            self.schedule.moved(self.llama.scratch)

    def _fail_everyone(self, error: RunnerError) -> None:
        for slot in self.slots:
            if slot.sequence is not None:
                self.post.fail(slot, error)
        for seq in self.placer.take_all():  # waiting, or waiting for a disk read
            seq.end(Failed(error))
        self._embeds.fail_all(error)

    def _free(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # still inside native code; the process exit will reclaim it
        if self.caches.disk is not None:  # what the idle slots and RAM hold outlives us
            states = [(s.reusable(), kvbytes.get(self.llama.ctx, s.seq_id), s.checkpoints)
                      for s in self.slots
                      if s.state is SlotState.IDLE and self.caches.wanted(s.reusable())]
            self.caches.flush([(t, d, tuple(c)) for t, d, c in states if d is not None])
        self.embed_ctx.free()
        self.run.feed.free()
        if self.spec is not None:
            self.spec.free()
        if self.resizer is not None and not self.resizer.free():
            return  # a KV build is stuck in native code on the model: it stays
        self.llama.free()
