"""What the engine does to one sequence's KV cells, beside decoding into them: drop them,
shift them, save them to the prompt cache, and fill them from it or from another slot."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import llama_cpp as L

from corral.runner.kv import kvbytes
from corral.runner.cache.caches import PrefixCaches
from corral.runner.prefix import KVBytes, common_prefix
from corral.runner.engine.placer import Placement, Source
from corral.runner.slots.slot import Slot, SlotState


def drop(mem: Any, slot: Slot) -> None:
    """Free every cell of the slot's sequence; it caches nothing after."""
    L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    slot.cached = []


def shift_context(mem: Any, slot: Slot, can_shift: bool) -> bool:
    """Context shift: drop half of what follows num_keep. False when the job must end
    instead ('length'): shifting is off, impossible, or would drop nothing."""
    job = slot.job
    assert job is not None
    if not (job.shift and can_shift) or job.num_predict == -2:
        return False
    keep = max(0, min(job.num_keep, slot.n_past // 2))
    discard = (slot.n_past - keep) // 2
    if discard <= 0:
        return False
    L.llama_memory_seq_rm(mem, slot.seq_id, keep, keep + discard)
    L.llama_memory_seq_add(mem, slot.seq_id, keep + discard, slot.n_past, -discard)
    del slot.cached[keep:keep + discard]
    # Tokens after the cut were computed beside tokens that are gone, and a
    # sliding-window cache keeps more than the positions say: none of this
    # sequence is what a fresh prefill of its tokens would give.
    slot.tainted = True
    return True


def recover(mem: Any, rc: int, failed: list[Slot], slots: list[Slot]) -> bool:
    """After a failed decode: True when dropping idle slots' cached prefixes made room
    (rc 1: no KV cells) and the failed slots retry next step from where they were.
    Else their sequences are dropped and the caller fails their jobs."""
    evicted = False
    if rc == 1:
        for slot in slots:
            if slot.state is SlotState.IDLE and slot.cached:
                drop(mem, slot)
                evicted = True
    for slot in failed:
        if evicted:
            L.llama_memory_seq_rm(mem, slot.seq_id, slot.n_past, -1)
        else:
            drop(mem, slot)
    return evicted


# ---- prefixes from elsewhere: the prompt cache and other slots ---------------------------

def save(ctx: Any, slot: Slot, caches: PrefixCaches, n_prefix: int = 0,
         held: Iterable[Sequence[int]] = ()) -> None:
    """Before a slot's cached tokens past `n_prefix` are overwritten: if enough would be lost,
    copy the slot's state into the prompt cache. Lost is what neither `n_prefix`, another
    slot staying in the context (`held`: the last of them is saved when it goes) nor a
    cache entry holds: sixteen requests that shared a document and differ in a short
    question leave one copy of it, and a slot taken from them copies nothing out."""
    tokens, least = slot.reusable(), caches.ram.min_tokens
    if len(tokens) - n_prefix < least:  # a warm turn keeps its slot's tokens: nothing to look at
        return
    kept = max((common_prefix(other, tokens) for other in held), default=0)
    if len(tokens) - kept < least or not caches.wanted(tokens):
        return
    data = kvbytes.get(ctx, slot.seq_id)
    if data is not None:
        caches.save(tokens, data)


def load_prefix(ctx: Any, mem: Any, p: Placement, caches: PrefixCaches, streams: int,
                held: Iterable[Sequence[int]], donors: dict[tuple[int, int], KVBytes],
                can_shift: bool = False, scratch: "Scratch | None" = None) -> int:
    """Put the placement's prefix into its slot's KV; returns the tokens it holds after
    (0 when a copy failed: the prompt is then prefilled whole). The slot's own cache
    goes to the prompt cache first if the placement overwrites it and neither the other
    slots (`held`) nor the cache hold it. `donors` keeps the states read from donor
    slots between placements of one round (no decode runs between them, so a donor's
    KV is unchanged): fifteen requests branching from one slot read it once."""
    slot = p.slot
    save(ctx, slot, caches, p.n_prefix if p.source is Source.REUSE else 0, held)
    if p.source in (Source.NONE, Source.REUSE):
        n_prefix = p.n_prefix
        if p.seq.job.reuse_chunk > 0 and can_shift and not p.seq.job.images:
            n_prefix = reuse_chunks(mem, slot, p.tokens, n_prefix, p.seq.job.reuse_chunk,
                                    scratch.free() if scratch is not None else None)
            if scratch is not None:
                scratch.took(slot)
        if n_prefix and L.llama_memory_seq_rm(mem, slot.seq_id, n_prefix, -1):
            return n_prefix
        L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
        return 0
    branch = p.donor is not None
    # A disk entry's bytes were read and verified off this thread (runner.cache.diskread).
    data = donor_state(ctx, p.donor, donors) if p.donor is not None \
        else p.data if p.data is not None else caches.fetch(p.entry)
    L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    # A partial removal fails on memories that cannot roll back (recurrent models).
    if data is not None and kvbytes.put(ctx, data, slot.seq_id, streams) \
            and L.llama_memory_seq_rm(mem, slot.seq_id, p.n_prefix, -1):
        if branch:
            caches.tokens_shared += p.n_prefix
        else:
            caches.restored(p.entry, p.disk, p.n_prefix, data)
        return p.n_prefix
    L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    caches.refused(p.entry)
    return 0


def reuse_chunks(mem: Any, slot: Slot, tokens: list[int], n_prefix: int, least: int,
                 scratch: int | None = None) -> int:
    """llama-server's --cache-reuse (server-context.cpp): past the common prefix, each run
    of at least `least` cached tokens that comes again in the prompt is shifted to where
    the prompt has it, instead of evaluated again: an editor's suffix, behind a prefix
    that lost a word. Returns the prompt tokens the slot holds after. The moved KV was
    computed after other tokens, so the slot is `tainted`: only requests that ask for
    shifted reuse may keep it.

    A prefix that grew (a keystroke: text inserted before the suffix) is where
    llama-server evaluates the whole suffix again, since new tokens cannot be decoded
    below cells a sequence holds already. With a `scratch` sequence in the same KV stream
    the suffix's cells are parked there, shifted to where the prompt will have them, and
    joined back once the inserted tokens are decoded (`Scratch.join`): the slot's
    `join_at` and `parked` say where and how many."""
    cached, head_c, head_p = slot.cached, n_prefix, n_prefix
    end = len(tokens) - 1  # the last prompt token is decoded for its logits
    after = head_c  # the cached tokens past the last run that moved
    while head_c < len(cached) and head_p < end:
        n = _run(cached, head_c, tokens, head_p, end)
        if n < least:
            head_c += 1
            continue
        L.llama_memory_seq_rm(mem, slot.seq_id, head_p, head_c)
        L.llama_memory_seq_add(mem, slot.seq_id, head_c, head_c + n, head_p - head_c)
        slot.tainted = True
        head_c, head_p = head_c + n, head_p + n
        after = head_c
    if scratch is None or head_p >= end:
        return head_p
    found = _insertion(cached, after, tokens, head_p, end, least)
    return head_p if found is None else _park(mem, slot, scratch, head_p, *found)


# Tokens typed before a cached run that are looked at for where it starts again: an
# editor sends a few per keystroke; past this many the run is not worth the search.
MAX_INSERT = 512


def _run(cached: list[int], c: int, tokens: list[int], p: int, end: int) -> int:
    """How many tokens from cached[c] equal those from tokens[p] (before `end`)."""
    n = 0
    while c + n < len(cached) and p + n < end and cached[c + n] == tokens[p + n]:
        n += 1
    return n


def _insertion(cached: list[int], head_c: int, tokens: list[int], head_p: int, end: int,
               least: int) -> tuple[int, int, int] | None:
    """The nearest prompt position q past `head_p` where a run of at least `least` of the
    cached tokens (from c, past `head_c`) starts again: (q, c, its length), or None."""
    starts: dict[int, list[int]] = {}
    for c in range(head_c, len(cached) - least + 1):
        starts.setdefault(cached[c], []).append(c)
    for q in range(head_p + 1, min(end - least + 1, head_p + 1 + MAX_INSERT)):
        best = max(((_run(cached, c, tokens, q, end), c) for c in starts.get(tokens[q], ())),
                   default=(0, 0))
        if best[0] >= least:
            return q, best[1], best[0]
    return None


def _park(mem: Any, slot: Slot, scratch: int, head_p: int, q: int, c: int, m: int) -> int:
    """Move cached[c:c+m] to the scratch sequence at positions q.., and keep head_p
    tokens: the prompt's tokens from head_p to q are decoded, then `Scratch.join` brings
    the run back. A cell's position belongs to the cell, so it leaves this sequence before it
    moves."""
    seq = slot.seq_id
    L.llama_memory_seq_rm(mem, scratch, -1, -1)
    L.llama_memory_seq_cp(mem, seq, scratch, c, c + m)
    L.llama_memory_seq_rm(mem, seq, head_p, -1)
    L.llama_memory_seq_add(mem, scratch, c, c + m, q - c)
    slot.join_at, slot.parked, slot.tainted = q, m, True
    return head_p


class Scratch:
    """The scratch sequence of a context with one shared KV stream (runner.llama.context),
    and the one slot at a time whose run is parked on it (`reuse_chunks`)."""

    def __init__(self, seq: int | None) -> None:
        self.seq = seq
        self.slot: Slot | None = None

    def free(self) -> int | None:
        """The scratch sequence's id when a placement may park a run there."""
        return self.seq if self.slot is None else None

    def took(self, slot: Slot) -> None:
        if slot.join_at >= 0:
            self.slot = slot

    def join(self, mem: Any, slots: list[Slot]) -> None:
        """After a batch: a prompt that reached its parked run takes it back; its cached
        tokens (and its sequence's evaluated count) take the run in."""
        slot = self.slot
        if slot is None or slot not in slots or slot.n_past != slot.join_at:
            return
        seq = slot.sequence
        assert seq is not None and self.seq is not None
        L.llama_memory_seq_cp(mem, self.seq, slot.seq_id, slot.join_at,
                              slot.join_at + slot.parked)
        L.llama_memory_seq_rm(mem, self.seq, -1, -1)
        slot.cached.extend(seq.pending[:slot.parked])
        del seq.pending[:slot.parked]
        seq.n_prompt_eval -= slot.parked
        slot.join_at, slot.parked, self.slot = -1, 0, None

    def moved(self, seq: int | None) -> None:
        """The engine moved to a new context (runner.kv.growth), which did not take the
        scratch sequence's cells: a parked run is evaluated again, as if never parked."""
        if self.slot is not None:
            self.slot.join_at, self.slot.parked = -1, 0
        self.seq, self.slot = seq, None

    def release(self, mem: Any) -> None:
        """A parked run whose sequence left its slot (ended, failed, preempted) goes."""
        if self.slot is not None and self.slot.join_at < 0:
            assert self.seq is not None
            L.llama_memory_seq_rm(mem, self.seq, -1, -1)
            self.slot = None


def donor_state(ctx: Any, donor: Slot, donors: dict[tuple[int, int], KVBytes]) -> KVBytes | None:
    """A donor slot's state, read once per round of placements (keyed by its sequence
    and length: a slot that took a prefix this round is a new key)."""
    key = (donor.seq_id, donor.n_past)
    if key not in donors:
        data = kvbytes.get(ctx, donor.seq_id)
        if data is None:
            return None
        donors[key] = data
    return donors[key]
