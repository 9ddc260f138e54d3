"""The scheduler: which models are loaded, for how long, and who waits.

Each loaded model is a small state machine (LOADING -> READY -> UNLOADING) with
a reference count of active requests and a keep-alive deadline that only runs
while the count is zero. Loads happen one at a time; requests for models that
are already loaded go on meanwhile. All state lives under one lock and every
transition is in this file.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from functools import partial
from dataclasses import replace
from typing import Callable, Iterator

from corral.config import FOREVER, Settings
from corral.errors import CorralError, RunnerError, ServerBusy
from corral.options import Options
from corral.process import physical_cores, physical_memory_available, physical_memory_total
from corral.registry.gguf import GGUFInfo, inspect_gguf
from corral.registry.models import ModelRecord
from corral.runner import fitestimate
from corral.runner.loadconfig import LoadConfig
from corral.server.residency.loadplan import load_config
from corral.server.residency.courier import Courier, in_parallel, stop_within
from corral.server.residency.fit import MemoryFit, cache_bytes
from corral.server.residency.resident import Resident, ModelState, Runner, Ticket
from corral.server.residency.threads import shares

__all__ = ["Resident", "ModelState", "Runner", "Scheduler", "Ticket"]

log = logging.getLogger("corral.scheduler")

BUSY = "server busy, please try again.  maximum pending requests exceeded"
HEALTH_EVERY = 2.0  # seconds between two rounds of health checks of the loaded runners
HEALTH_DEADLINE = 5.0  # for the watch's own checks: an answer slower than this is silence
FRESH_DEADLINE = 0.5  # for `ps` and the like: past this they show the last answer


UNLOAD_DEADLINE = 120.0  # a runner's stop: a minute for its disk tier, then SIGKILL


class Scheduler:
    def __init__(self, settings: Settings,
                 runner_factory: Callable[[LoadConfig], Runner],
                 clock: Callable[[], float] = time.time,
                 free_memory: Callable[[], int] = physical_memory_available,
                 free_vram: Callable[[], int] = fitestimate.daemon_free_gpu_memory,
                 total_memory: Callable[[], int] = physical_memory_total,
                 inspect: Callable[[ModelRecord], GGUFInfo] = lambda r: inspect_gguf(r.model_path),
                 cores: int = 0, unload_deadline: float = 0.0) -> None:
        self.settings = settings
        self.unload_deadline = unload_deadline or UNLOAD_DEADLINE
        self.runner_factory = runner_factory
        self.clock = clock
        self.fit = MemoryFit(settings, free_memory, free_vram, total_memory, inspect)
        self.courier = Courier()  # calls to runners that no request waits for
        self.cores = cores or physical_cores()  # what the busy runners share
        self.loaded: dict[str, Resident] = {}
        self.cond = threading.Condition()
        self.pending = 0
        self.blocked = 0  # requests waiting in acquire for a load, an unload or room
        self._load_lock = threading.Lock()
        self._stopping = False
        self._timer = threading.Thread(target=self._expire_loop, name="keepalive", daemon=True)
        self._timer.start()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch_loop, name="watch", daemon=True).start()

    # ---- admission -------------------------------------------------------------------------

    def admit(self, record: ModelRecord) -> "Ticket":
        """Count a new request in, or refuse it at once when too many are waiting.

        A request for a loaded model counts against that model straight away, so
        a burst is judged by how many would wait beyond the model's slots.
        """
        with self.cond:
            waiting = self.pending + sum(max(0, m.inflight - m.slots)
                                         for m in self.loaded.values())
            entry = self.loaded.get(record.digest)
            if entry is not None and entry.state is ModelState.READY:
                if entry.inflight >= entry.slots and waiting >= self.settings.max_queue:
                    raise ServerBusy(BUSY)
                entry.inflight += 1
                return Ticket(entry)
            if waiting >= self.settings.max_queue:
                raise ServerBusy(BUSY)
            self.pending += 1
            return Ticket(None)

    def acquire(self, ticket: "Ticket", record: ModelRecord, options: Options,
                keep_alive: float | None) -> Resident:
        """Return a READY model with this request counted in; loads or reloads as needed."""
        load_opts = self._load_options(options, record)
        try:
            while True:
                with self.cond:
                    if self._stopping:
                        raise RunnerError("server is shutting down")
                    current = self.loaded.get(record.digest)
                    if current is not None and current.state is ModelState.READY:
                        if self._forget_if_dead(current) or \
                                self._forget_if_silent(current, self.clock(), wanted=True):
                            continue
                        if not load_opts.differs(current.options):
                            current.refcount += 1
                            if ticket.entry is not current:
                                current.inflight += 1
                                self._settle(ticket)
                            ticket.entry, ticket.settled = current, True
                            current.expires_at = None
                            if keep_alive is not None:
                                current.keep_alive = keep_alive
                            return current
                        current.reload = True
                        if current.refcount == 0:
                            self._begin_unload(current)
                    if current is not None or not self._make_room(record):
                        self._wait()
                        continue
                    slots = self.fit.slots(record, load_opts)
                    entry = Resident(record, load_opts, slots,
                                   keep_alive=self.settings.keep_alive if keep_alive is None
                                   else keep_alive)
                    self.loaded[record.digest] = entry
                self._load(entry)
        finally:
            with self.cond:
                self._settle(ticket)
                self.cond.notify_all()

    def _wait(self) -> None:
        """Wait (lock held) for a model to load, unload or free up; `blocked` counts the
        requests doing so, for anyone who must know one is waiting (tests among them)."""
        self.blocked += 1
        try:
            self.cond.wait(timeout=0.5)
        finally:
            self.blocked -= 1

    def _settle(self, ticket: "Ticket") -> None:
        """Undo the admission count once the request holds (or gave up on) a model."""
        if ticket.settled:
            return
        ticket.settled = True
        if ticket.entry is not None:
            ticket.entry.inflight -= 1
        else:
            self.pending -= 1

    def release(self, entry: Resident) -> None:
        with self.cond:
            entry.refcount -= 1
            entry.inflight -= 1
            if entry.refcount == 0 and entry.state is ModelState.READY:
                if entry.reload or entry.keep_alive == 0:
                    self._begin_unload(entry)
                elif entry.keep_alive == FOREVER:
                    entry.expires_at = None
                else:
                    entry.expires_at = self.clock() + entry.keep_alive
            self.cond.notify_all()

    @contextmanager
    def hold(self, record: ModelRecord, options: Options,
             keep_alive: float | None) -> Iterator[Resident]:
        """Count a request in, hold a ready model for it, and always release it; the
        cores are shared again as the set of busy models changes."""
        entry = self.acquire(self.admit(record), record, options, keep_alive)
        try:
            self.share_cores()  # it may have just become busy
            yield entry
        finally:
            self.release(entry)
            self.share_cores()

    def load(self, record: ModelRecord, options: Options,
             keep_alive: float | None) -> float:
        """Hold the model without generating (Ollama's empty prompt, a preload); returns
        the seconds it took to be ready."""
        start = time.perf_counter()
        with self.hold(record, options, keep_alive):
            pass
        return time.perf_counter() - start

    def share_cores(self) -> None:
        """Tell each runner its share of the cores when the set of busy ones changed. A
        runner loaded with an explicit num_thread keeps it and takes no part."""
        with self.cond:
            ready = [m for m in self.loaded.values() if m.state is ModelState.READY
                     and m.runner is not None and m.options.num_thread is None]
            new = shares(self.cores, [m.key for m in ready if m.refcount > 0],
                         [m.key for m in ready if m.refcount == 0])
            for m in ready:
                if m.threads != new[m.key] and m.runner is not None:
                    m.threads = new[m.key]
                    self.courier.send((id(m.runner), "threads"),
                                      partial(m.runner.set_threads, m.threads))

    def runner_failed(self, entry: Resident) -> None:
        """A request saw the runner die: mark it unloaded so the next request reloads."""
        with self.cond:
            self._forget_if_dead(entry)

    def _forget_if_dead(self, entry: Resident) -> bool:
        """The one check for a runner that died (lock held): a READY model whose process
        is gone is forgotten, so the next request loads it afresh."""
        if entry.state is ModelState.READY and entry.runner is not None \
                and not entry.runner.alive():
            self._forget(entry, "llama runner process has terminated")
            return True
        return False

    # ---- watching the runners ----------------------------------------------------------------

    def watch_once(self) -> None:
        """One round of health checks, with the client's deadline (a few seconds)."""
        in_parallel([partial(self._ask, m, HEALTH_DEADLINE) for m in self.running()],
                    HEALTH_DEADLINE)

    def refresh(self) -> None:
        """Ask the answering runners now, for `ps`, `show` and /metrics, which want what
        is held this moment: a runner that misses the short deadline, or was silent at the
        last check and is not asked, is shown by its last answer."""
        in_parallel([partial(self._ask, m, FRESH_DEADLINE) for m in self.running()
                     if m.silent_since is None], FRESH_DEADLINE)

    def _ask(self, entry: Resident, deadline: float) -> None:
        runner = entry.runner
        if runner is None:
            return
        try:
            health = runner.health(deadline)
        except CorralError:
            with self.cond:
                if not self._forget_if_dead(entry):
                    if entry.silent_since is None:
                        entry.silent_since = self.clock()
                    self._forget_if_silent(entry, self.clock(), wanted=entry.refcount > 0)
            return
        with self.cond:
            entry.health, entry.silent_since = health, None

    def _watch_loop(self) -> None:
        while not self._stopped.wait(HEALTH_EVERY):
            self.watch_once()

    def _forget_if_silent(self, entry: Resident, now: float, wanted: bool) -> bool:
        """A runner that answered no health check for CORRAL_RUNNER_TIMEOUT while a request
        wants it is stopped, swapped out or wedged: it is killed (its requests end with an
        error) and the next request loads the model afresh (lock held)."""
        silent = entry.silent_since
        if not wanted or silent is None or now - silent < self.settings.runner_timeout:
            return False
        self._forget(entry, f"the runner answered nothing for {now - silent:.0f} s "
                            "(CORRAL_RUNNER_TIMEOUT); it was killed")
        return True

    # ---- loading -------------------------------------------------------------------------

    def _load_options(self, options: Options, record: ModelRecord) -> Options:
        opts = options.load()
        # auto (-1) never forces a reload; nor does draft_num_predict on a model that has
        # no draft model for it to bound
        return replace(opts, num_ctx=opts.num_ctx or self.settings.context_length
                       or self.fit.default_ctx(record),
                       num_gpu=None if opts.num_gpu == -1 else opts.num_gpu,
                       draft_num_predict=opts.draft_num_predict if record.draft else None)

    def _make_room(self, record: ModelRecord) -> bool:
        """Evict idle models (shortest keep-alive first) until the new one may load."""
        limit = self.settings.max_loaded_models or 3
        need = record.model_path.stat().st_size if record.model_path.exists() else 0
        while True:
            live = [m for m in self.loaded.values() if m.state is not ModelState.UNLOADING]
            fits = len(live) < limit and (not live or need <= self.fit.spare(live))
            if fits:
                if live and need > self.fit.budget():
                    self._clear_caches(live)  # prompt caches go before any model does
                return not any(m.state is ModelState.UNLOADING for m in self.loaded.values())
            idle = [m for m in live if m.refcount == 0 and m.state is ModelState.READY]
            if not idle:
                return False
            victim = min(idle, key=lambda m: (m.keep_alive if m.keep_alive >= 0 else 1e18,
                                              m.expires_at or 0))
            self._begin_unload(victim)

    def _clear_caches(self, live: list[Resident]) -> None:
        for m in live:
            if m.runner is not None and cache_bytes(m):
                self.courier.send((id(m.runner), "clear"), m.runner.clear_cache)

    def _load(self, entry: Resident) -> None:
        with self._load_lock:  # one load at a time
            config = load_config(entry, self.settings, self.fit)
            runner = self.runner_factory(config)
            try:
                runner.start(self.settings.load_timeout)
            except CorralError as exc:
                with self.cond:
                    self.loaded.pop(entry.key, None)
                    self.cond.notify_all()
                log.error("loading %s failed: %s", entry.record.name.display(), exc.message)
                raise
        with self.cond:
            entry.runner = runner
            entry.state = ModelState.READY
            self.cond.notify_all()
        log.info("loaded %s with %d slots", entry.record.name.display(), entry.slots)

    # ---- unloading -------------------------------------------------------------------------

    def _begin_unload(self, entry: Resident) -> None:
        """READY -> UNLOADING (lock held); the runner stops on a helper thread."""
        if entry.state is not ModelState.READY:
            return
        entry.state = ModelState.UNLOADING
        threading.Thread(target=self._finish_unload, args=(entry,), daemon=True).start()

    def _finish_unload(self, entry: Resident) -> None:
        """The runner stops (its own deadlines: a disk tier's write, then SIGKILL); a stop
        that never returns (a process stuck in a driver, past even SIGKILL) is given up on
        after `unload_deadline`, so the entry goes and later loads are not blocked."""
        if entry.runner is not None and not stop_within(entry.runner.stop,
                                                        self.unload_deadline):
            log.error("%s: the runner did not stop within %.0f s, even killed; its memory "
                      "may still be held", entry.record.name.display(), self.unload_deadline)
        with self.cond:
            if self.loaded.get(entry.key) is entry:
                del self.loaded[entry.key]
            self.cond.notify_all()
        log.info("unloaded %s", entry.record.name.display())

    def _forget(self, entry: Resident, why: str) -> None:
        log.error("%s: %s", entry.record.name.display(), why)
        entry.state = ModelState.UNLOADING
        if self.loaded.get(entry.key) is entry:
            del self.loaded[entry.key]
        if entry.runner is not None:  # a failed engine's runner first ends its streams
            threading.Thread(target=entry.runner.end, daemon=True).start()
        self.cond.notify_all()

    def unload(self, record: ModelRecord) -> None:
        """keep_alive 0 without a prompt: unload once idle."""
        with self.cond:
            entry = self.loaded.get(record.digest)
            if entry is None:
                return
            entry.keep_alive = 0
            if entry.refcount == 0:
                self._begin_unload(entry)

    def expire_once(self, now: float) -> float:
        """One pass of the keep-alive timer at `now`: dead runners are forgotten and
        expired idle models begin to unload. Returns the seconds until the next deadline
        (at most 1). The timer thread calls it; tests call it with their own clock."""
        with self.cond:
            deadlines = []
            for entry in list(self.loaded.values()):
                if self._forget_if_dead(entry):
                    continue
                if entry.refcount == 0 and entry.expires_at is not None:
                    if entry.expires_at <= now:
                        self._begin_unload(entry)
                    else:
                        deadlines.append(entry.expires_at)
            return max(min([d - now for d in deadlines] + [1.0]), 0.01)

    def _expire_loop(self) -> None:
        with self.cond:
            while not self._stopping:
                self.cond.wait(timeout=self.expire_once(self.clock()))

    def running(self) -> list[Resident]:
        with self.cond:
            return [m for m in self.loaded.values() if m.state is ModelState.READY]

    def stop(self) -> None:
        self._stopped.set()
        with self.cond:
            self._stopping = True
            entries = list(self.loaded.values())
            self.cond.notify_all()
        # All at once, and a stop that never returns holds no shutdown either.
        in_parallel([partial(stop_within, partial(e.runner.stop, timeout=5),
                             self.unload_deadline) for e in entries if e.runner is not None],
                    self.unload_deadline)
        with self.cond:
            self.loaded.clear()

