"""A slot is one llama.cpp sequence: a state machine with every transition here.

    IDLE --admit--> PREFILL --prompt done--> DECODE --finish--> IDLE
                      \\--------------finish / cancel / error------^

An IDLE slot keeps its tokens' KV cached, so the next request that shares a
prefix with them prefills only the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.jobs import Job
from runner.textstream import StopMatcher, Utf8Stream

if TYPE_CHECKING:
    from runner.sampling import Sampler


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


class DoneReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCEL = "cancel"


@dataclass
class Slot:
    seq: int
    num_ctx: int
    state: SlotState = SlotState.IDLE
    cached: list[int] = field(default_factory=list)  # tokens whose KV is resident, in order
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    job: Job | None = None
    sampler: "Sampler | None" = None
    last_token: int = -1
    n_generated: int = 0
    n_prompt_eval: int = 0
    limit: int = 0  # most tokens this job may generate
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    generated: list[int] = field(default_factory=list)
    t_start: float = 0.0
    t_first: float = 0.0
    last_used: float = 0.0
    tainted: bool = False  # a context shift changed the KV under the cached tokens

    def reusable(self) -> list[int]:
        """The cached tokens a new request may keep: none once a context shift ran."""
        return [] if self.tainted else self.cached

    def transition(self, new: SlotState) -> None:
        if (self.state, new) not in _ALLOWED:
            raise RuntimeError(f"slot {self.seq}: illegal transition {self.state} -> {new}")
        self.state = new

    @property
    def n_past(self) -> int:
        return len(self.cached)

    def start(self, job: Job, keep: int, sampler: "Sampler", limit: int, now: float) -> None:
        """IDLE -> PREFILL: `keep` cached tokens are reused, the rest of the prompt is pending."""
        self.transition(SlotState.PREFILL)
        self.job = job
        self.cached = self.cached[:keep]
        self.tainted = False
        self.pending = job.prompt[keep:]
        self.sampler = sampler
        self.limit = limit
        self.n_generated = 0
        self.n_prompt_eval = len(self.pending)
        self.generated = []
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(job.stop)
        self.t_start = now
        self.t_first = 0.0

    def release(self, now: float) -> Job | None:
        """Back to IDLE, keeping the cached KV for prefix reuse."""
        job = self.job
        self.transition(SlotState.IDLE)
        if self.sampler is not None:
            self.sampler.free()
        self.sampler = None
        self.job = None
        self.pending = []
        self.last_used = now
        return job


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
