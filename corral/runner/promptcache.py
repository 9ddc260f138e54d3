"""The host-memory prompt cache: the KV of sequences that left the context, kept so that
a prompt sharing a long prefix with one is restored instead of prefilled again.

Chats and agents resend long prompts (a system prompt, tools, a document, the whole
conversation) and ask for short answers, so prefill is where the time goes. A slot
keeps its tokens' KV while idle, but elastic KV holds one slot while idle and a slot
goes to whichever prompt comes next: two conversations that alternate would each
prefill everything on every turn. So when a slot's cached tokens are about to be
overwritten (its slot goes to another prompt, a shrink, a full pool, an unload), the
engine copies the sequence's state out of llama.cpp (`llama_state_seq_get_data`) into
this cache, and restores the entry sharing the longest prefix with a new prompt.

Pure policy over bytes, used by the engine thread alone: the longest common prefix
wins (ties: the most recently used); entries are evicted least recently used to stay
within the byte budget; an entry whose tokens are a prefix of another's holds nothing
the longer one does not, so it goes when the longer one comes. Everything that changes
the KV besides the tokens (model, adapters, KV type, context parameters) is fixed for
one runner process, and an image's tokens are placeholders derived from its hash
(runner.vision), so the tokens alone are the key here; the disk tier
(runner.diskcache), which outlives the process, adds the rest to its key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from corral.runner.slot import common_prefix

if TYPE_CHECKING:
    from corral.runner.diskcache import DiskEntry, DiskTier

# Shorter prefixes are cheaper to prefill than to copy in and out of llama.cpp.
MIN_TOKENS = 32


@dataclass
class Entry:
    tokens: tuple[int, ...]
    data: bytes  # llama_state_seq_get_data's output for those tokens
    used: int = 0  # the cache's clock at its last save or restore

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class CacheStats:
    hits: int = 0
    tokens_restored: int = 0  # prompt tokens restored instead of evaluated
    saved: int = 0
    evicted: int = 0


@dataclass
class PromptCache:
    budget: int  # bytes; 0 turns the cache off
    min_tokens: int = MIN_TOKENS
    # Called with each entry evicted for room (the disk tier keeps it); not on clear().
    spill: Callable[[Entry], object] | None = None
    entries: list[Entry] = field(default_factory=list)
    stats: CacheStats = field(default_factory=CacheStats)
    _clock: int = 0

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def lookup(self, tokens: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that length; (None, 0)
        when none shares at least min_tokens."""
        best: Entry | None = None
        best_n = 0
        for entry in self.entries:
            n = common_prefix(entry.tokens, tokens)
            if n > best_n or (n == best_n and best is not None and entry.used > best.used):
                best, best_n = entry, n
        if best is None or best_n < self.min_tokens:
            return None, 0
        return best, best_n

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds these tokens' KV (it may hold more after them)."""
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[:n] == tuple(tokens) for e in self.entries)

    def worth_saving(self, tokens: Sequence[int]) -> bool:
        return self.budget > 0 and len(tokens) >= self.min_tokens and not self.covers(tokens)

    def add(self, tokens: Sequence[int], data: bytes) -> bool:
        """Keep a state; False when it cannot fit or is held already."""
        key = tuple(tokens)
        if not data or len(data) > self.budget or not self.worth_saving(key):
            return False
        # Entries that are prefixes of this one are redundant now.
        self.entries = [e for e in self.entries if e.tokens != key[:len(e.tokens)]]
        self._clock += 1
        self.entries.append(Entry(key, data, self._clock))
        self.stats.saved += 1
        self._evict(self.budget)
        return True

    def restored(self, entry: Entry, n: int) -> None:
        """An entry's first n tokens went into a slot: it is the most recently used."""
        self._clock += 1
        entry.used = self._clock
        self.stats.hits += 1
        self.stats.tokens_restored += n

    def remove(self, entry: Entry) -> None:
        """An entry that llama.cpp refused to restore: it never will."""
        if entry in self.entries:
            self.entries.remove(entry)

    def clear(self) -> int:
        """Drop everything (memory is wanted elsewhere); returns the bytes freed."""
        freed = self.size
        self.entries = []
        return freed

    def _evict(self, budget: int) -> None:
        size = self.size
        while self.entries and size > budget:
            victim = min(self.entries, key=lambda e: e.used)
            self.entries.remove(victim)
            size -= victim.size
            self.stats.evicted += 1
            if self.spill is not None:
                self.spill(victim)

    def describe(self) -> dict[str, int]:
        """What ps, show and /metrics report."""
        return {"cache_bytes": self.size, "cache_budget": self.budget,
                "cache_entries": len(self.entries), "cache_hits": self.stats.hits,
                "cache_tokens_restored": self.stats.tokens_restored}


@dataclass(frozen=True)
class Hit:
    """Where a prompt's longest cached prefix is: a RAM entry or a disk entry."""

    n: int
    entry: Entry | None = None
    disk: "DiskEntry | None" = None


class PrefixCaches:
    """The RAM cache and its optional disk tier as the engine sees them: one lookup, one
    place to keep a state, and the accounting of what was restored and shared."""

    def __init__(self, ram: PromptCache, disk: "DiskTier | None" = None) -> None:
        self.ram, self.disk = ram, disk
        self.tokens_shared = 0  # prompt tokens branched from another running slot
        if disk is not None:
            ram.spill = lambda e: disk.save(e.tokens, e.data)

    def lookup(self, tokens: Sequence[int]) -> Hit:
        entry, n = self.ram.lookup(tokens)
        hit = Hit(n, entry=entry)
        if self.disk is not None:
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

    def keep(self, tokens: Sequence[int], data: bytes) -> None:
        if not self.ram.add(tokens, data) and self.disk is not None \
                and len(data) > self.ram.budget:
            self.disk.save(tokens, data)  # too big for RAM (or RAM off): straight to disk

    def fetch(self, entry: Entry | None, disk: "DiskEntry | None") -> bytes | None:
        if entry is not None:
            return entry.data
        return self.disk.load(disk) if self.disk is not None and disk is not None else None

    def restored(self, entry: Entry | None, disk: "DiskEntry | None", n: int,
                 data: bytes | None) -> None:
        if entry is None and disk is not None and data is not None:
            self.ram.add(disk.tokens, data)  # read once from disk, then served from RAM
            entry, _ = self.ram.lookup(disk.tokens)
        if entry is not None:
            self.ram.restored(entry, n)
        else:
            self.ram.stats.hits += 1
            self.ram.stats.tokens_restored += n

    def refused(self, entry: Entry | None) -> None:
        if entry is not None:
            self.ram.remove(entry)

    def flush(self, states: list[tuple[list[int], bytes]]) -> int:
        """At unload: the given slot states and every RAM entry, newest first, go to the
        disk tier (when there is one); returns how many were written."""
        if self.disk is None:
            return 0
        written = 0
        for tokens, data in states:
            written += self.disk.save(tokens, data)
        for entry in sorted(self.ram.entries, key=lambda e: -e.used):
            written += self.disk.save(entry.tokens, entry.data)
        return written

    def describe(self) -> dict[str, int]:
        out = {**self.ram.describe(), "cache_tokens_shared": self.tokens_shared}
        if self.disk is not None:
            out.update(cache_disk_bytes=self.disk.size, cache_disk_entries=len(self.disk.entries))
        return out
