"""What a step does to sequences' KV cells, decided without llama.cpp: each rule reads
slots and the prompt cache and returns ops (runner.engine.plan), which run executes in
the plan's order (runner.engine.kvops). Schedule (runner.engine.schedule) keeps the
slots' bookkeeping in step with them."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from corral.runner.cache.caches import PrefixCaches
from corral.runner.engine.placer import Placement, Source
from corral.runner.engine.plan import (Branch, Drop, KVOp, Move, Park, Restore, Rewind, Save,
                                       Shift, Trim)
from corral.runner.jobs import position
from corral.runner.prefix import common_prefix
from corral.runner.slots.slot import Slot


def save_op(slot: Slot, caches: PrefixCaches, n_prefix: int = 0,
            held: Iterable[Sequence[int]] = ()) -> Save | None:
    """Before a slot's cached tokens past `n_prefix` are overwritten: if enough would be lost,
    copy the slot's state into the prompt cache. Lost is what neither `n_prefix`, another
    slot staying in the context (`held`: the last of them is saved when it goes) nor a
    cache entry holds: sixteen requests that shared a document and differ in a short
    question leave one copy of it, and a slot taken from them copies nothing out."""
    tokens, least = slot.reusable(), caches.ram.min_tokens
    if len(tokens) - n_prefix < least:  # a warm turn keeps its slot's tokens: nothing to look at
        return None
    kept = max((common_prefix(other, tokens) for other in held), default=0)
    if len(tokens) - kept < least or not caches.wanted(tokens):
        return None
    return Save(slot.seq_id, list(tokens), tuple(slot.checkpoints))


def shift_op(slot: Slot, can_shift: bool) -> Shift | None:
    """Context shift: drop half of what follows num_keep. None when the job must end
    instead ('length'): shifting is off, impossible, or would drop nothing. A prompt with
    M-RoPE images never shifts: its positions are not its token counts, which are all a
    shift moves (llama.cpp refuses such a context too, but that is not ours to lean on)."""
    job = slot.job
    assert job is not None
    if not (job.shift and can_shift) or job.num_predict == -2:
        return None
    if any(span.grid is not None for span in job.images):
        return None
    keep = max(0, min(job.num_keep, slot.n_past // 2))
    discard = (slot.n_past - keep) // 2
    if discard <= 0:
        return None
    return Shift(slot.seq_id, keep, discard, slot.n_past)


def placement_ops(p: Placement, caches: PrefixCaches, held: Iterable[Sequence[int]],
                  can_shift: bool = False, scratch: int | None = None
                  ) -> tuple[list[KVOp], int, bool]:
    """The ops that put the placement's prefix into its slot's KV, the tokens it holds
    after, and whether reuse chunks moved KV there (`reuse_moves`; with a free `scratch`
    sequence a Park may be among them). The slot's own cache goes to the prompt cache
    first if the placement overwrites it and neither the other slots (`held`) nor the
    cache hold it. Should a Trim, Restore or Branch fail at run time, the slot holds
    nothing and prefills the whole prompt."""
    slot, job = p.slot, p.seq.job
    ops: list[KVOp] = []
    save = save_op(slot, caches, p.n_prefix if p.source is Source.REUSE else 0, held)
    if save is not None:
        ops.append(save)
    if p.source in (Source.NONE, Source.REUSE):
        n_prefix, moves = p.n_prefix, []  # type: tuple[int, list[Move | Park]]
        if job.reuse_chunk > 0 and can_shift and not job.images:
            moves, n_prefix = reuse_moves(slot.seq_id, slot.cached, p.tokens, n_prefix,
                                          job.reuse_chunk, scratch)
        ops += moves
        at = position(job.images, n_prefix)
        if p.checkpoint is not None:  # a recurrent memory goes back to where it was
            ops.append(Rewind(slot.seq_id, n_prefix, p.checkpoint))
        else:
            ops.append(Trim(slot.seq_id, at) if n_prefix else Drop(slot.seq_id))
        return ops, n_prefix, bool(moves)
    at = position(job.images, p.n_prefix)
    at = -1 if at == p.n_prefix else at  # past an M-RoPE image, positions run behind
    if p.donor is not None:
        ops.append(Branch(slot.seq_id, p.donor.seq_id, p.n_prefix, at))
    else:  # a disk entry's bytes were read and verified off this thread (runner.cache.diskread)
        data = p.data if p.data is not None else caches.fetch(p.entry)
        ops.append(Restore(slot.seq_id, p.n_prefix, data, p.entry, p.disk, at, p.checkpoint,
                           p.checkpoints))
    return ops, p.n_prefix, False


def reuse_moves(seq_id: int, cached: list[int], tokens: list[int], n_prefix: int,
                least: int, scratch: int | None = None) -> tuple[list[Move | Park], int]:
    """llama-server's --cache-reuse (server-context.cpp): past the common prefix, each run
    of at least `least` cached tokens that comes again in the prompt is shifted to where
    the prompt has it, instead of evaluated again: an editor's suffix, behind a prefix
    that lost a word. Returns the moves and the prompt tokens the slot holds after.
    The moved KV was computed after other tokens, so the slot is then tainted: only
    requests that ask for shifted reuse may keep it.

    A prefix that grew (a keystroke: text inserted before the suffix) is where
    llama-server evaluates the whole suffix again, since new tokens cannot be decoded
    below cells a sequence holds already. With a `scratch` sequence in the same KV stream
    the suffix's run is parked there instead (a Park, last of the moves), shifted to
    where the prompt will have it, and joined back once the typed tokens are decoded."""
    moves: list[Move | Park] = []
    head_c, head_p = n_prefix, n_prefix
    end = len(tokens) - 1  # the last prompt token is decoded for its logits
    after = head_c  # the cached tokens past the last run that moved
    while head_c < len(cached) and head_p < end:
        n = _run(cached, head_c, tokens, head_p, end)
        if n < least:
            head_c += 1
            continue
        moves.append(Move(seq_id, head_c, head_p, n))
        head_c, head_p = head_c + n, head_p + n
        after = head_c
    if scratch is not None and head_p < end:
        found = _insertion(cached, after, tokens, head_p, end, least)
        if found is not None:
            q, c, n = found
            moves.append(Park(seq_id, scratch, head_p, c, q, n))
    return moves, head_p


# Tokens typed before a cached run that are looked at for where it starts again: an
# editor sends a few per keystroke; past this many the run is not worth the search.
MAX_INSERT = 512
# Where a token starts cached runs this many times, only its first starts are tried: a
# suffix of one repeated token (blank lines, indentation) would otherwise cost positions
# x occurrences x run length in Python on every placement. The earliest start has the
# longest run in such a suffix, so little is lost.
MAX_STARTS = 8


def _run(cached: list[int], c: int, tokens: list[int], p: int, end: int) -> int:
    """How many tokens from cached[c] equal those from tokens[p] (before `end`)."""
    n = 0
    while c + n < len(cached) and p + n < end and cached[c + n] == tokens[p + n]:
        n += 1
    return n


def _insertion(cached: list[int], head_c: int, tokens: list[int], head_p: int, end: int,
               least: int, run: Callable[[list[int], int, list[int], int, int], int] = _run
               ) -> tuple[int, int, int] | None:
    """The nearest prompt position q past `head_p` where a run of at least `least` of the
    cached tokens (from c, past `head_c`) starts again: (q, c, its length), or None.
    At most MAX_INSERT positions, and MAX_STARTS starts a token, are tried (`run`: a
    test's count of the work)."""
    starts: dict[int, list[int]] = {}
    for c in range(head_c, len(cached) - least + 1):
        found = starts.setdefault(cached[c], [])
        if len(found) < MAX_STARTS:
            found.append(c)
    for q in range(head_p + 1, min(end - least + 1, head_p + 1 + MAX_INSERT)):
        best = max(((run(cached, c, tokens, q, end), c) for c in starts.get(tokens[q], ())),
                   default=(0, 0))
        if best[0] >= least:
            return q, best[1], best[0]
    return None
