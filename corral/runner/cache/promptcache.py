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
the longer one does not, so it goes when the longer one comes, and so does one that
holds fewer than min_tokens the newer one does not (the same document with another
short question). Everything that changes the KV besides the tokens (model, adapters,
KV type, context parameters) is fixed for one runner process, and an image's tokens
are placeholders derived from its hash (runner.llama.vision), so the tokens alone are the key
here; the disk tier (runner.cache.diskcache), which outlives the process, adds the rest to
its key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from corral.runner.prefix import Checkpoints, KVBytes, common_prefix

# Shorter prefixes are cheaper to prefill than to copy in and out of llama.cpp.
MIN_TOKENS = 32


@dataclass
class Entry:
    tokens: tuple[int, ...]
    data: KVBytes  # llama_state_seq_get_data's output for those tokens
    used: int = 0  # the cache's clock at its last save or restore
    # Its slot's checkpoints (Slot.checkpoints, where the memory cannot be cut): where a prompt that
    # keeps fewer of the tokens goes back to, its state cut there
    checkpoints: Checkpoints = ()

    @property
    def size(self) -> int:
        return len(self.data) + sum(len(c) for _, c in self.checkpoints)


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
        """Bytes held: the entries' and their checkpoints'."""
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

    def add(self, tokens: Sequence[int], data: KVBytes,
            checkpoints: Checkpoints = ()) -> Entry | None:
        """Keep a state (and its checkpoints); None when it cannot fit or is held already."""
        key = tuple(tokens)
        if not data or len(data) > self.budget or not self.worth_saving(key):
            return None
        # Entries that hold fewer than min_tokens this one does not are redundant now: the
        # turn it continues (its prefix), or the same document with another short
        # question (sixteen requests at once, which then leave one copy, the newest).
        least = self.min_tokens
        self.entries = [e for e in self.entries
                        if len(e.tokens) - common_prefix(e.tokens, key) >= least]
        self._clock += 1
        entry = Entry(key, data, self._clock, checkpoints)
        self.entries.append(entry)
        self.stats.saved += 1
        self._evict(self.budget)
        return entry if entry in self.entries else None

    def restored(self, entry: Entry | None, n: int) -> None:
        """n tokens of a state went into a slot; its entry, when RAM holds it (one read
        from disk may not fit), is the most recently used."""
        if entry is not None:
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
