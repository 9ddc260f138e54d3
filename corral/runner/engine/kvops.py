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
                can_shift: bool = False) -> int:
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
            n_prefix = reuse_chunks(mem, slot, p.tokens, n_prefix, p.seq.job.reuse_chunk)
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


def reuse_chunks(mem: Any, slot: Slot, tokens: list[int], n_prefix: int, least: int) -> int:
    """llama-server's --cache-reuse (server-context.cpp): past the common prefix, each run
    of at least `least` cached tokens that comes again in the prompt is shifted to where
    the prompt has it, instead of evaluated again: an editor's suffix, behind a prefix
    that grew by a word. Returns the prompt tokens the slot holds after. The moved KV was
    computed after other tokens, so the slot is `tainted`: only requests that ask for
    shifted reuse may keep it."""
    cached, head_c, head_p = slot.cached, n_prefix, n_prefix
    end = len(tokens) - 1  # the last prompt token is decoded for its logits
    while head_c < len(cached) and head_p < end:
        n = 0
        while head_c + n < len(cached) and head_p + n < end and \
                cached[head_c + n] == tokens[head_p + n]:
            n += 1
        if n < least:
            head_c += 1
            continue
        L.llama_memory_seq_rm(mem, slot.seq_id, head_p, head_c)
        L.llama_memory_seq_add(mem, slot.seq_id, head_c, head_c + n, head_p - head_c)
        slot.tainted = True
        head_c, head_p = head_c + n, head_p + n
    return head_p


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
