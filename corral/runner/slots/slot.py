"""A slot is one llama.cpp sequence (its cells in the shared KV buffer, or a KV stream
of its own): a state machine with every transition here.

    IDLE --assign--> PREFILL --prompt done--> DECODE --vacate--> IDLE
                       \\-------------------vacate-----------------^

It holds at most one Sequence (runner.slots.sequence), which carries the request's
progress; the slot knows only the tokens whose KV it holds. An IDLE slot keeps
them cached, so the next request that shares a prefix prefills only the rest; when
another prompt takes the slot, they go to the prompt cache (runner.cache.promptcache).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from corral.runner.jobs import Job, position
from corral.runner.prefix import KVBytes
from corral.runner.slots.sequence import Sequence


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


_ALLOWED = {
    (SlotState.IDLE, SlotState.PREFILL),
    (SlotState.PREFILL, SlotState.DECODE),
    (SlotState.PREFILL, SlotState.IDLE),
    (SlotState.DECODE, SlotState.IDLE),
}


class Owed(NamedTuple):
    """A prompt's last token, taken back from a slot whose sequence ended in the step that
    read it (runner.engine.postprocess `_retake`): decoded again at rest, at `pos`, while
    the slot still holds `held` tokens (runner.engine.run Run.redo)."""

    held: int
    token: int
    pos: int


@dataclass
class Slot:
    seq_id: int  # llama.cpp's sequence id (with a stream per slot, which stream)
    num_ctx: int
    state: SlotState = SlotState.IDLE
    cached: list[int] = field(default_factory=list)  # tokens whose KV is resident, in order
    sequence: Sequence | None = None
    last_used: float = 0.0
    tainted: bool = False  # a context shift changed the KV under the cached tokens
    # Where the memory cannot be cut back (runner.prefix Cuts), its states at some of the
    # cached tokens' lengths (runner.engine.plan Mark), oldest first: where a later prompt
    # that keeps fewer of them goes back to.
    checkpoints: list[tuple[int, KVBytes]] = field(default_factory=list)
    # Where a window cache's KV of `cached` starts being whole (runner.prefix Cuts.recent):
    # a state copied in (a restore, a branch, a checkpoint, a settle) brings only the
    # cells its end's window sees; what is decoded after comes on top.
    window_from: int = 0
    # The token its cells lack, where its sequence ended as the token was taken back:
    # what the slot, and a save of it, would hold but for that (a new sequence forgets it).
    owed: Owed | None = None

    def checkpoint_bytes(self) -> int:
        """What the checkpoints hold: host memory (any thread may ask: the list is
        replaced, never changed in place)."""
        return sum(len(data) for _, data in self.checkpoints)

    def reusable(self, approximate: bool = False) -> list[int]:
        """The cached tokens a new request may keep: none once a context shift ran,
        unless the request takes shifted KV (`approximate`: Job.reuse_chunk)."""
        return [] if self.tainted and not approximate else self.cached

    def transition(self, new: SlotState) -> None:
        if (self.state, new) not in _ALLOWED:
            raise RuntimeError(f"slot {self.seq_id}: illegal transition {self.state} -> {new}")
        self.state = new

    @property
    def n_past(self) -> int:
        """Tokens (KV cells) the sequence holds; its next position is `pos(n_past)`."""
        return len(self.cached)

    def pos(self, index: int) -> int:
        """The position of the sequence's token `index`: the index, save past an M-RoPE
        image of the running job's prompt (runner.jobs.position)."""
        return position(self.job.images, index) if self.job is not None else index

    # The sequence's fields the step planner and the pool read, through its slot.
    @property
    def job(self) -> Job | None:
        return self.sequence.job if self.sequence is not None else None

    @property
    def pending(self) -> list[int]:
        return self.sequence.pending if self.sequence is not None else []

    @property
    def last_token(self) -> int:
        return self.sequence.last_token if self.sequence is not None else -1

    @property
    def t_start(self) -> float:
        return self.sequence.t_start if self.sequence is not None else 0.0

    def assign(self, sequence: Sequence, prefix: list[int], shifted: bool = False) -> None:
        """IDLE -> PREFILL: the sequence runs here; its KV holds `prefix` already (kept
        from this slot's cache, or copied in from another slot or the prompt cache;
        `shifted`: some of it moved there, runner.engine.kvplan.reuse_moves)."""
        self.transition(SlotState.PREFILL)
        self.sequence, self.owed = sequence, None
        self.cached = list(prefix)
        self.tainted = shifted
        self.keep_checkpoints(len(prefix))

    def keep_checkpoints(self, n: int) -> None:
        """Only the checkpoints within the first `n` cached tokens still hold."""
        self.checkpoints = [c for c in self.checkpoints if c[0] <= n]

    def vacate(self, now: float) -> Sequence | None:
        """Back to IDLE, keeping the cached KV for prefix reuse; returns the sequence."""
        sequence, self.sequence = self.sequence, None
        self.transition(SlotState.IDLE)
        self.last_used = now
        return sequence

