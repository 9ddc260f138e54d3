"""The plan of one engine step, as data: what schedule (runner.engine.schedule) decided
and hands to run and postprocess (the loop is runner.engine.engine's).

    KV ops   what happens to sequences' cells before the batch (saves to the prompt cache,
             drops, trims, chunk moves, restores, branches, shifts, an infill's run
             parked on the scratch sequence and joined back), in the order schedule
             decided them: its bookkeeping after each is the state that op leaves
    batch    the rows of the next llama_batch (runner.engine.batchplan), drafts included
    retake   the prompts it ends whose last token their memory takes back after, for
             their state one token short (a checkpoint), read without a step of its own
    image    one slice of one image, decoded through its own batch once the rows are sampled
    ends     sequences that end this step without sampling (cancelled, refused, out
             of context), delivered by postprocess, which frees their samplers

Pure records: schedule builds them without llama.cpp, and its tests read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from corral.errors import CorralError
from corral.runner.engine.batchplan import Batch
from corral.runner.prefix import Checkpoints, KVBytes
from corral.runner.slots.sequence import DoneReason, Sequence
from corral.runner.slots.slot import Slot

if TYPE_CHECKING:
    from corral.runner.cache.diskcache import DiskEntry
    from corral.runner.cache.promptcache import Entry
    from corral.runner.jobs import ImageSpan


# ---- what happens to one sequence's KV cells (run executes them: runner.engine.kvops) ----

@dataclass(frozen=True)
class Save:
    """Copy the sequence's state into the prompt cache as `tokens`' (before it is
    overwritten), with its slot's checkpoints (where its memory cannot be cut: Cuts)."""

    seq_id: int
    tokens: list[int]
    checkpoints: Checkpoints = ()


@dataclass(frozen=True)
class Drop:
    """Free every cell of the sequence."""

    seq_id: int


@dataclass(frozen=True)
class Trim:
    """Keep the first `n_prefix` positions (all cells go when it is 0). A partial removal
    fails on memories that cannot cut there (runner.prefix Cuts): the placement fails.
    `draft`: a rejected draft's tokens, which such a memory takes back (a recurrent one
    from its snapshots of the last ubatch, runner.layerkinds RS_SEQ)."""

    seq_id: int
    n_prefix: int
    draft: bool = False


@dataclass(frozen=True)
class Move:
    """A reuse chunk (runner.engine.kvplan.reuse_moves): `n` cells at `src` move to `dst`
    (< src), over the cells between, which go."""

    seq_id: int
    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Shift:
    """Context shift: `discard` cells after the first `keep` go, the rest move down."""

    seq_id: int
    keep: int
    discard: int
    n_past: int


@dataclass(frozen=True)
class Restore:
    """Fill the sequence with a prompt cache entry's state, cut to `n_prefix` tokens, at
    position `at` where that is not `n_prefix` (past an M-RoPE image; runner.jobs). Where
    the memory cannot be cut there, it goes back to the entry's `checkpoint` first."""

    seq_id: int
    n_prefix: int
    data: KVBytes | None
    entry: "Entry | None" = None
    disk: "DiskEntry | None" = None
    at: int = -1
    checkpoint: KVBytes | None = None
    checkpoints: Checkpoints = ()  # a disk entry's, which RAM keeps with its state

    @property
    def cut(self) -> int:
        return self.n_prefix if self.at < 0 else self.at


@dataclass(frozen=True)
class Branch:
    """Fill the sequence with another sequence's state (`donor`), cut to `n_prefix`
    tokens, at position `at` where that is not `n_prefix` (as Restore's)."""

    seq_id: int
    donor: int
    n_prefix: int
    at: int = -1

    @property
    def cut(self) -> int:
        return self.n_prefix if self.at < 0 else self.at


@dataclass(frozen=True)
class Park:
    """Text typed before a cached run (runner.engine.kvplan.reuse_moves): the run's `n`
    cells at `src` go to the `scratch` sequence, moved to `dst`, and the sequence keeps
    its first `keep` positions; the typed tokens are decoded, then a Join brings them
    back. One KV stream holds both sequences, so no cell is copied."""

    seq_id: int
    scratch: int
    keep: int
    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Join:
    """The sequence reached `at`: the `n` cells parked on `scratch` join it there."""

    seq_id: int
    scratch: int
    at: int
    n: int


@dataclass(frozen=True)
class Mark:
    """A checkpoint: the slot's sequence, which holds the slot's cached tokens, has its
    state that no cut reaches (a recurrent state, a window cache's KV: kvbytes.get_partial)
    read and kept with the slot at that length
    (Slot.checkpoints), for a later prompt that keeps fewer of them (a Rewind)."""

    slot: Slot

    @property
    def seq_id(self) -> int:
        return self.slot.seq_id


@dataclass(frozen=True)
class Rewind:
    """Back to a checkpoint: the state read at `n_prefix` tokens goes back in, and the
    attention cells past it go (the cut of a memory that cannot be cut anywhere)."""

    seq_id: int
    n_prefix: int
    data: KVBytes


KVOp = Union[Save, Drop, Trim, Move, Shift, Restore, Branch, Park, Join, Mark, Rewind]
# The ops that put a placement's prefix in place; when one fails, the placement does.
PLACING = (Trim, Restore, Branch, Rewind)


# ---- the rest of a step -----------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    """A sequence put on its slot this step: its prefix comes from the plan's ops on the
    slot's seq_id, and `tokens` (the prompt, or a resumed sequence's prompt and output)
    are what it prefills from scratch should they fail."""

    slot: Slot
    seq: Sequence
    tokens: list[int]
    new: bool  # first placement (not a preempted sequence resuming)


@dataclass(frozen=True)
class ImageSlice:
    """`count` tokens of the slot's image `span`, from `offset` into it; `last`: they end
    the prompt, so the last one's logits are sampled."""

    slot: Slot
    span: "ImageSpan"
    offset: int
    count: int
    last: bool


@dataclass(frozen=True)
class End:
    """A sequence that ends this step: Failed with `error`, or Done for `reason`, with its
    counts (`stats`) unless it was cancelled while queued."""

    seq: Sequence
    reason: DoneReason = DoneReason.STOP
    error: CorralError | None = None
    stats: bool = True


@dataclass(frozen=True)
class Demand:
    """What elastic KV's policy is told after the step (runner.kv.growth Resizer.tick)."""

    busy: int
    waiting: int
    now: float
    warm: int


@dataclass
class StepPlan:
    busy: bool = False  # a sequence holds a slot: the step runs (else only `ends` go out)
    ops: list[KVOp] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)
    batch: Batch = field(default_factory=Batch)
    image: ImageSlice | None = None
    # Prompts the batch ends whose memory takes their last token back once it is sampled,
    # for the state one token short (runner.engine.schedule Schedule._retakes)
    retake: set[int] = field(default_factory=set)
    ends: list[End] = field(default_factory=list)
    demand: Demand | None = None  # set where the context can grow or shrink

    @property
    def slots(self) -> list[Slot]:
        """The slots with rows in the batch."""
        return self.batch.slots
