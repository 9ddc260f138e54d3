"""A sequence is one request's progress: a state machine with every transition here.

    WAITING --start--> RUNNING --finish--> FINISHED
       |                 |  ^
       |              preempt resume
       |                 v  |
       |             PREEMPTED --finish (cancelled, failed)--> FINISHED
       \\--finish (cancelled or refused while queued)--> FINISHED

It owns what a generation has produced (sampler, text streams, the tokens
generated, counts and times), so it moves between slots whole: a slot is only a
KV stream that holds one sequence at a time. A preempted sequence goes back to the
queue with everything it had; when it resumes, its prompt and the tokens it
generated are prefilled again and sampling continues where it stopped.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corral.runner.jobs import Job, JobEvent, Token
from corral.runner.llama.textstream import StopMatcher, Utf8Stream
from corral.runner.speculative.source import History
from corral.runner.speculative.policy import DraftPolicy
from corral.runner.wire import DoneLine

if TYPE_CHECKING:
    from corral.runner.llama.sampling import Sampler

log = logging.getLogger("corral.runner")


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued, never run
    RUNNING = "running"  # on a slot, prefilling or decoding
    PREEMPTED = "preempted"  # off its slot with its progress, queued again
    FINISHED = "finished"


_ALLOWED = {
    (SeqState.WAITING, SeqState.RUNNING),
    (SeqState.WAITING, SeqState.FINISHED),
    (SeqState.RUNNING, SeqState.FINISHED),
    (SeqState.RUNNING, SeqState.PREEMPTED),
    (SeqState.PREEMPTED, SeqState.RUNNING),
    (SeqState.PREEMPTED, SeqState.FINISHED),
}


class DoneReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCEL = "cancel"


@dataclass
class Sequence:
    job: Job
    state: SeqState = SeqState.WAITING
    sampler: "Sampler | None" = None
    # Tokens still to prefill on its slot; once it decodes, a prompt token its memory took
    # back, read again before the next (runner.engine.schedule Schedule._retakes)
    pending: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    last_token: int = -1
    n_generated: int = 0
    n_prompt_eval: int = 0
    n_prompt: int = 0  # the prompt as read: the context may have cut the job's
    limit: int = 0  # most tokens it may generate
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    t_start: float = 0.0
    t_first: float = 0.0
    # Speculative decoding (runner.speculative): its tokens as the n-gram index reads them, and
    # how many it drafts next; both stay with it when it is preempted.
    history: History = field(default_factory=lambda: History([]))
    draft: DraftPolicy = field(default_factory=DraftPolicy)
    # The text this step gave it, not yet sent: a step's pieces (a draft's kept tokens
    # among them) go to its caller as one event, so its stream writes once a step.
    held: list[Token] = field(default_factory=list)

    def transition(self, new: SeqState) -> None:
        if (self.state, new) not in _ALLOWED:
            raise RuntimeError(f"sequence {self.job.id or id(self)}: illegal transition "
                               f"{self.state} -> {new}")
        self.state = new

    def start(self, limit: int, tokens: list[int], n_prefix: int, now: float) -> None:
        """WAITING -> RUNNING: `n_prefix` of `tokens` are cached on its slot already. Its
        sampler is set before it first decodes (runner.engine.run makes it: native)."""
        self.transition(SeqState.RUNNING)
        self.limit = limit
        self.stops = StopMatcher(self.job.stop)
        self.pending = tokens[n_prefix:]
        self.n_prompt_eval, self.n_prompt = len(self.pending), len(tokens)
        if len(tokens) < len(self.job.prompt):  # said once: a client is told only the count
            log.warning("a prompt of %d tokens was cut to %d to fit the context; a larger "
                        "num_ctx reads it whole", len(self.job.prompt), len(tokens))
        self.t_start = now
        self.history = History(tokens)

    def resume(self, tokens: list[int], n_prefix: int) -> None:
        """PREEMPTED -> RUNNING: `tokens` (its prompt and what it generated) are prefilled
        again from `n_prefix`; sampling then continues from where it stopped."""
        self.transition(SeqState.RUNNING)
        self.pending = tokens[n_prefix:]
        self.last_token = tokens[-1]

    def preempt(self) -> None:
        """RUNNING -> PREEMPTED: its slot's KV is dropped; its progress stays here."""
        self.transition(SeqState.PREEMPTED)
        self.pending = []

    def finish(self) -> None:
        """-> FINISHED from any live state: the sampler's native memory goes back."""
        self.transition(SeqState.FINISHED)
        if self.sampler is not None:
            self.sampler.free()
            self.sampler = None
        self.pending = []

    def emit(self, piece: Token) -> None:
        """Text for its caller, sent with the rest of this step's at `send`."""
        self.held.append(piece)

    def send(self) -> None:
        """What this step gave it, as one event (nothing when it gave nothing)."""
        if not self.held:
            return
        held, self.held = self.held, []
        self.job.events.put(held[0] if len(held) == 1 else Token(
            "".join(p.text for p in held), tuple(lp for p in held for lp in p.logprobs)))

    def end(self, event: "JobEvent") -> None:
        """Finish, and tell its caller how it ended (Done or Failed), after any text it
        still holds: nothing it generated is lost, whatever ends it."""
        self.send()
        self.finish()
        self.job.events.put(event)

    def stats(self, reason: DoneReason, now: float) -> DoneLine:
        """The Done event's counts and durations (Ollama's names)."""
        first = self.t_first or now
        job = self.job
        return DoneLine(
            done_reason=reason.value,
            prompt_eval_count=self.n_prompt_eval,
            prompt_eval_duration=int((first - self.t_start) * 1e9),
            eval_count=self.n_generated,
            eval_duration=int((now - first) * 1e9),
            queue_duration=int((self.t_start - job.submitted) * 1e9),
            prompt_tokens=self.n_prompt or len(job.prompt),  # what was read
            # Image placeholders mean nothing outside this runner's vision cache.
            context=tuple([t for t in job.prompt if t >= 0] + self.generated)
            if job.return_context else (),
            draft_count=self.draft.drafted,
            draft_accepted_count=self.draft.accepted,
        )
