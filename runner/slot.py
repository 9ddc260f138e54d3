"""A slot is one llama.cpp sequence: a state machine with every transition here.

    IDLE --admit--> PREFILL --prompt done--> DECODE --finish--> IDLE
                      \\--------------finish / cancel / error------^
                      \\--------------preempt (KV pool full)-------^

A preempted job leaves with its Progress (sampler, text streams, the tokens
generated so far) and later resumes on some slot: its prompt and those tokens
are prefilled again, and generation continues where it stopped.

An IDLE slot keeps its tokens' KV cached, so the next request that shares a
prefix with them prefills only the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corral.runner.jobs import Job
from corral.runner.textstream import StopMatcher, Utf8Stream

if TYPE_CHECKING:
    from corral.runner.sampling import Sampler


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
class Progress:
    """What a job has produced so far, carried across a preemption."""

    sampler: "Sampler"
    utf8: Utf8Stream
    stops: StopMatcher
    generated: list[int]
    n_generated: int
    n_prompt_eval: int
    limit: int
    t_start: float
    t_first: float


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

    def suspend(self, now: float) -> tuple[Job, Progress]:
        """PREFILL/DECODE -> IDLE without finishing: the job keeps its progress. The
        caller drops the sequence's KV, so nothing of it stays cached here."""
        job, sampler = self.job, self.sampler
        assert job is not None and sampler is not None
        progress = Progress(sampler, self.utf8, self.stops, self.generated, self.n_generated,
                            self.n_prompt_eval, self.limit, self.t_start, self.t_first)
        self.sampler = None  # the job owns it now
        self.release(now)
        self.cached = []
        return job, progress

    def resume(self, job: Job, keep: int, tokens: list[int], progress: Progress) -> None:
        """IDLE -> PREFILL for a preempted job: `tokens` (its prompt and what it had
        generated) are prefilled again; sampling then continues from its progress."""
        self.transition(SlotState.PREFILL)
        self.job, self.sampler = job, progress.sampler
        self.cached = self.cached[:keep]
        self.tainted = False
        self.pending = tokens[keep:]
        self.limit, self.n_generated = progress.limit, progress.n_generated
        self.n_prompt_eval = progress.n_prompt_eval
        self.generated, self.utf8, self.stops = progress.generated, progress.utf8, progress.stops
        self.t_start, self.t_first = progress.t_start, progress.t_first
        self.last_token = tokens[-1]

    def stats(self, job: Job, reason: DoneReason, now: float) -> dict[str, object]:
        """The Done event's counts and durations (Ollama's names)."""
        first = self.t_first or now
        return {
            "done_reason": reason.value,
            "prompt_eval_count": self.n_prompt_eval,
            "prompt_eval_duration": int((first - self.t_start) * 1e9),
            "eval_count": self.n_generated,
            "eval_duration": int((now - first) * 1e9),
            "queue_duration": int((self.t_start - job.submitted) * 1e9),
            "prompt_tokens": len(job.prompt),
            # Image placeholders mean nothing outside this runner's vision cache.
            "context": [t for t in job.prompt if t >= 0] + self.generated,
        }

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
