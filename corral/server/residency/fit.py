"""The memory fit: how many slots a model gets, how big a KV pool, and whether another
model fits beside the loaded ones. It reads free memory and the runners' last health
answers (Resident.health), and never calls a runner: the scheduler asks it under its lock.
"""

from __future__ import annotations

from typing import Callable

from corral.config import Settings
from corral.errors import CorralError
from corral.options import Options
from corral.process import physical_memory_available, physical_memory_total
from corral.registry.gguf import GGUFInfo, inspect_gguf
from corral.registry.models import ModelRecord
from corral.runner import fitestimate
from corral.server.residency.resident import Resident


class MemoryFit:
    def __init__(self, settings: Settings,
                 free_memory: Callable[[], int] = physical_memory_available,
                 free_vram: Callable[[], int] = fitestimate.daemon_free_gpu_memory,
                 total_memory: Callable[[], int] = physical_memory_total,
                 inspect: Callable[[ModelRecord], GGUFInfo] = lambda r: inspect_gguf(r.model_path)
                 ) -> None:
        self.settings = settings
        self.free_memory = free_memory
        self.free_vram = free_vram
        self.total_memory = total_memory
        self.inspect = inspect  # the daemon passes its store's cached reader
        self._contexts: dict[str, int] = {}  # each model's default num_ctx, once made

    def default_ctx(self, record: ModelRecord) -> int:
        """num_ctx for a request that sets none, where CORRAL_CONTEXT_LENGTH is auto
        (fitestimate.context_that_fits). Made once per model file: a later request, with
        less memory free, must ask for the same context or it would reload the model."""
        key = str(record.model_path)
        if key not in self._contexts:
            try:
                info = self.inspect(record)
            except CorralError:
                return fitestimate.DEFAULT_CTX_MIN
            budget = self.budget() - self._draft(record, fitestimate.DEFAULT_CTX_MIN, 1)
            if not self.free_vram():  # the prompt cache takes host RAM beside the KV
                budget -= self.cache_ram()
            self._contexts[key] = fitestimate.context_that_fits(
                info, budget, self.settings.kv_cache_type,
                window_cache=self._window_cache(), speculative=self.settings.speculative)
        return self._contexts[key]

    def slots(self, record: ModelRecord, opts: Options) -> int:
        """A fixed CORRAL_NUM_PARALLEL wins; else as many as the memory estimate fits, up
        to CORRAL_MAX_SLOTS: the cap elastic KV may grow to (it starts at one)."""
        if self.settings.num_parallel > 0:
            return self.settings.num_parallel
        cap = self.settings.max_slots or (fitestimate.GPU_MAX_SLOTS if self.free_vram() > 0 else
                                          fitestimate.CPU_MAX_SLOTS)
        if self.settings.kv_pool:
            return cap  # sequences share the pool; num_ctx caps each, reserves nothing
        try:
            info = self.inspect(record)
        except CorralError:
            return 1
        budget = self.budget()
        if budget <= 0:
            return 1
        if not self.free_vram():  # the model's prompt cache takes host RAM beside its KV
            budget -= self.cache_ram()
        budget -= self._draft(record, int(opts.num_ctx or 0), cap)
        if self.settings.speculative and record.draft is None:  # the n-gram index, at most,
            # and the KV of the model's own MTP head, where it has one (the estimate
            # counts the layers the model decodes with)
            budget -= fitestimate.NGRAM_INDEX_BYTES + fitestimate.head_kv_bytes(
                info, int(opts.num_ctx or 0), cap, self.settings.kv_cache_type)
        return fitestimate.slots_that_fit(info, int(opts.num_ctx or 0), budget, cap,
                                          self.settings.kv_cache_type,
                                          window_cache=self._window_cache(),
                                          speculative=self.settings.speculative)

    def _window_cache(self) -> bool:
        """Whether a sliding-window model may keep only its window's KV (as the runner
        decides: runner.llama.context): not where exactness is promised."""
        return not self.settings.deterministic

    def _draft(self, record: ModelRecord, num_ctx: int, slots: int) -> int:
        """A draft model's weights and KV, loaded beside the model (0: none, or it does
        not load: the runner then goes on without it)."""
        if record.draft is None or not self.settings.speculative or not record.draft.is_file():
            return 0
        try:
            info = inspect_gguf(record.draft)
        except CorralError:
            return 0
        return fitestimate.draft_bytes(info, record.draft.stat().st_size, num_ctx, slots,
                                       self.settings.kv_cache_type)

    def pool_tokens(self, record: ModelRecord, opts: Options, slots: int) -> int:
        """The shared KV buffer's size in tokens (0: a stream per slot). By default every
        slot's num_ctx, which the slot count already fits in memory; in pool mode the
        setting, or every sequence's cap as memory allows. One buffer either way: its
        pages are committed as cells are written (runner.kv.reserve)."""
        if self.settings.shared_kv:
            return slots * int(opts.num_ctx or 0)
        if not self.settings.kv_pool:
            return 0
        if self.settings.kv_pool_tokens:
            return self.settings.kv_pool_tokens  # the user's size, as given
        want = slots * int(opts.num_ctx or 0)
        try:
            info = self.inspect(record)
        except CorralError:
            return want
        budget = self.budget()
        if budget <= 0:
            return want
        return fitestimate.pool_tokens_that_fit(info, want, budget, slots,
                                           self.settings.kv_cache_type)

    def budget(self) -> int:
        """Free memory where the model's KV goes: VRAM on a GPU, else RAM (<= 0: unknown)."""
        return self.free_vram() or self.free_memory()

    def spare(self, live: list[Resident]) -> int:
        """Free memory, with the loaded models' prompt caches counted as free: they are
        dropped before any model is evicted (in host RAM, so only for a CPU load)."""
        free = self.budget()
        if free <= 0:
            return 1 << 62
        return free if self.free_vram() else free + sum(cache_bytes(m) for m in live)

    def cache_ram(self) -> int:
        free = 0 if self.free_vram() else self.free_memory()  # a GPU's KV is not in RAM
        return fitestimate.prompt_cache_budget(self.settings.cache_ram, self.total_memory(), free)


def cache_bytes(entry: Resident) -> int:
    """Bytes the model's prompt cache held in RAM at its last health answer (0: unknown)."""
    return entry.health.cache.bytes if entry.health is not None else 0
