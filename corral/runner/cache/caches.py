"""The prompt cache as the engine sees it: the RAM cache (runner.cache.promptcache) and its
optional disk tier (runner.cache.diskcache) behind one lookup, one place to save a state, and
the accounting of what was restored and what was shared between running requests."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from corral.runner.cache.diskcache import DiskEntry, DiskTier, namespace
from corral.runner.cache.promptcache import Entry, PromptCache
from corral.runner.prefix import Checkpoints, KVBytes

if TYPE_CHECKING:
    from corral.runner.llama.context import EngineConfig

log = logging.getLogger("corral.caches")
FLUSH_WAIT = 60.0  # seconds an unload waits for the disk tier's writes


@dataclass(frozen=True)
class Hit:
    """Where a prompt's longest cached prefix is: a RAM entry or a disk entry."""

    n: int
    entry: Entry | None = None
    disk: DiskEntry | None = None


class PrefixCaches:
    """The RAM cache and its optional disk tier as the engine sees them: one lookup, one
    place to save a state, and the accounting of what was restored and shared."""

    def __init__(self, ram: PromptCache, disk: DiskTier | None = None) -> None:
        self.ram, self.disk = ram, disk
        self.tokens_shared = 0  # prompt tokens branched from another running slot
        if disk is not None:
            ram.spill = lambda e: disk.save(e.tokens, e.data, e.checkpoints)

    def lookup(self, tokens: Sequence[int], disk: bool = True) -> Hit:
        """The longest cached prefix of `tokens`; in RAM only when `disk` is false (the
        disk tier is read off the engine thread: runner.cache.diskread)."""
        entry, n = self.ram.lookup(tokens)
        hit = Hit(n, entry=entry)
        if self.disk is not None and disk:
            found, n = self.disk.lookup(tokens)
            if found is not None and n > hit.n and n >= self.ram.min_tokens:
                hit = Hit(n, disk=found)
        return hit

    def wanted(self, tokens: Sequence[int]) -> bool:
        """Whether a state of these tokens is worth copying out of llama.cpp."""
        if len(tokens) < self.ram.min_tokens:
            return False
        return self.ram.worth_saving(tokens) or (
            self.disk is not None and self.ram.budget == 0)

    def save(self, tokens: Sequence[int], data: KVBytes,
             checkpoints: Checkpoints = ()) -> None:
        """A state into RAM, with its checkpoints (where the memory cannot be cut; the disk tier
        keeps the whole state only)."""
        if not self.ram.add(tokens, data, checkpoints) and self.disk is not None \
                and len(data) > self.ram.budget:
            self.disk.save(tokens, data, checkpoints)  # too big for RAM (or RAM off): to disk

    @staticmethod
    def fetch(entry: Entry | None) -> KVBytes | None:
        """A RAM entry's state. A disk entry's comes read and verified already, off the
        engine thread (runner.cache.diskread), with the placement."""
        return entry.data if entry is not None else None

    def restored(self, entry: Entry | None, disk: DiskEntry | None, n: int,
                 data: KVBytes | None, checkpoints: Checkpoints = ()) -> None:
        if entry is None and disk is not None and data is not None:  # read once from
            entry = self.ram.add(disk.tokens, data, checkpoints)  # disk, then from RAM
        self.ram.restored(entry, n)

    def refused(self, entry: Entry | None) -> None:
        if entry is not None:
            self.ram.remove(entry)

    def flush(self, states: list[tuple[list[int], KVBytes, Checkpoints]]) -> int:
        """At unload: the given slot states and every RAM entry, newest first, go to the
        disk tier (when there is one), and the writer is waited for (FLUSH_WAIT at most);
        returns how many were kept."""
        if self.disk is None:
            return 0
        written = 0
        for tokens, data, checkpoints in states:
            written += self.disk.save(tokens, data, checkpoints)
        for entry in sorted(self.ram.entries, key=lambda e: -e.used):
            written += self.disk.save(entry.tokens, entry.data, entry.checkpoints)
        if not self.disk.drain(FLUSH_WAIT):
            log.warning("prompt cache: the disk writer did not finish within %.0f s",
                        FLUSH_WAIT)
        return written

    def describe(self) -> dict[str, int]:
        out = {**self.ram.describe(), "cache_tokens_shared": self.tokens_shared}
        if self.disk is not None:
            out.update(cache_disk_bytes=self.disk.size, cache_disk_entries=len(self.disk.entries))
        return out


def caches_for(model_path: str, cfg: "EngineConfig") -> PrefixCaches:
    """The engine's prompt cache: RAM always (a budget of 0 turns it off), and the disk
    tier when CORRAL_CACHE_DISK gives it room, namespaced by what the KV depends on."""
    disk = None
    if cfg.cache_disk > 0 and cfg.cache_dir:
        from importlib.metadata import PackageNotFoundError, version

        try:  # the runner imports llama_cpp's bindings alone, without its __version__
            llama_version = version("llama-cpp-python")
        except PackageNotFoundError:
            llama_version = "unknown"

        def file_id(path: str) -> list[Any]:
            st = os.stat(path)
            return [os.path.basename(path), st.st_size, st.st_mtime_ns]

        identity = {"model": file_id(model_path), "kv": cfg.kv_cache_type,
                    "flash_attn": cfg.flash_attn, "deterministic": cfg.deterministic,
                    "gpu_layers": cfg.n_gpu_layers, "llama_cpp": llama_version,
                    "adapters": [file_id(a) + [s] for a, s in cfg.adapters]}
        if cfg.projector:  # two models sharing a text GGUF but not a projector embed an
            identity["projector"] = file_id(cfg.projector)  # image (and grid it) apart
        try:
            disk = DiskTier(Path(cfg.cache_dir), cfg.cache_disk, namespace(identity),
                            background=True)  # the engine never waits for a write
        except OSError as exc:
            log.warning("prompt cache disk tier off: %s", exc)
    return PrefixCaches(PromptCache(cfg.cache_ram), disk)
