"""Planning one engine step: which tokens of which slots go into the next batch.

Pure: it reads slot state and returns the batch, so it is tested without llama.cpp.
Every decoding slot's next token goes first (a running stream never waits),
then prompt chunks of prefilling slots, oldest request first, within the
batch budget. A long prompt therefore takes several steps, and the streams
beside it advance at every one of them.

Prompts that continue a long context (a conversation's new turn, sixteen questions
after a shared document) are grouped a few per step rather than all in one: see
ATTEND_BUDGET.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from corral.runner.slots.slot import Slot, SlotState


# A step stops taking further prompts once its prompt rows attend to this many cached
# cells. Every sequence whose prompt ends in a step gets its first token only when the
# whole step ends, so a step holding sixteen short tails after a 1,200-token document
# makes all sixteen wait for the last. Batching shares the weights' cost between rows
# but not attention's, which past a few hundred cells of context is most of a row's
# cost; so over long contexts a step of a few tails costs about what those tails cost
# alone, and the first of them start streaming steps earlier (a burst's TTFT p50 fell
# by about a quarter on the CPU). Short prompts at a short context attend to little
# and still go in one step, where batching is what pays.
ATTEND_BUDGET = 64 * 1024


class BatchRow(NamedTuple):
    """One row of the step's llama_batch: a token at a position of a sequence."""

    token: int
    pos: int
    seq_id: int
    logits: bool


@dataclass
class Batch:
    """The step's batch (runner.engine.plan.StepPlan holds it beside the step's other parts)."""

    rows: list[BatchRow] = field(default_factory=list)
    decoding: list[Slot] = field(default_factory=list)  # slots whose next token is in the batch
    prefill: list[tuple[Slot, int]] = field(default_factory=list)  # (slot, prompt tokens taken)
    sample_at: dict[int, int] = field(default_factory=dict)  # slot seq -> batch row to sample
    # slot seq -> the tokens drafted after its next one, each in a row of its own (after
    # its sample_at row), verified by sampling them in turn (runner.engine.postprocess)
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def slots(self) -> list[Slot]:
        return self.decoding + [slot for slot, _ in self.prefill]

    def without(self, seq_ids: set[int]) -> "Batch":
        """The same batch less every row of `seq_ids` (placements that failed at run): the
        other streams' rows, logits and drafts unchanged, their rows renumbered."""
        out = Batch(decoding=[s for s in self.decoding if s.seq_id not in seq_ids],
                    prefill=[(s, n) for s, n in self.prefill if s.seq_id not in seq_ids],
                    drafts={k: v for k, v in self.drafts.items() if k not in seq_ids})
        moved = {}
        for i, row in enumerate(self.rows):
            if row.seq_id not in seq_ids:
                moved[i] = len(out.rows)
                out.rows.append(row)
        out.sample_at = {k: moved[i] for k, i in self.sample_at.items() if k not in seq_ids}
        return out


def plan_step(slots: list[Slot], n_batch: int, drafts: dict[int, list[int]] | None = None,
              stops: dict[int, int] | None = None) -> Batch:
    """The batch: each decoding slot's next token (after a prompt token its memory took
    back, which it reads again) and its draft (`drafts`, slot seq -> the
    tokens to verify after it: speculation sized them for this step,
    runner.speculative.speculation), then prompt chunks, oldest request first. `stops`:
    slot seq -> the token count where its prefill stops for the step: where a parked run
    joins it (runner.engine.parking), or where a checkpoint is read (a recurrent memory's,
    runner.engine.schedule)."""
    plan, drafts, stops = Batch(), drafts or {}, stops or {}
    decoding, used = [], 0
    for slot in (s for s in slots if s.state is SlotState.DECODE):
        rows = 1 + len(slot.pending)
        if used + rows > n_batch:
            break
        decoding.append(slot)
        used += rows
    spare = (n_batch - used) // max(len(decoding), 1)
    # A bound, not a decision: the rows a draft may take never overflow the batch.
    drafted = [drafts.get(slot.seq_id, [])[:spare] for slot in decoding]
    for slot, tokens in zip(decoding, drafted):
        # a prompt's last token its memory took back after the step that read it
        # (runner.engine.schedule Schedule._retakes), read again before the next
        for k, token in enumerate(slot.pending):
            plan.rows.append(BatchRow(token, slot.pos(slot.n_past + k), slot.seq_id, False))
        plan.sample_at[slot.seq_id] = len(plan.rows)
        at = slot.pos(slot.n_past + len(slot.pending))
        plan.rows.append(BatchRow(slot.last_token, at, slot.seq_id, True))
        plan.decoding.append(slot)
        for k, token in enumerate(tokens):
            plan.rows.append(BatchRow(token, at + 1 + k, slot.seq_id, True))
        if tokens:
            plan.drafts[slot.seq_id] = tokens
    prefilling = sorted((s for s in slots if s.state is SlotState.PREFILL), key=lambda s: s.t_start)
    attended = 0
    for slot in prefilling:
        if len(plan.rows) >= n_batch or attended >= ATTEND_BUDGET:
            break
        room = n_batch - len(plan.rows)
        if slot.seq_id in stops:
            room = min(room, stops[slot.seq_id] - slot.n_past)
        take = text_run(slot.pending, room)
        if take == 0:
            continue  # an image comes next: it goes through its own batch (plan.ImageSlice)
        last_chunk = take == len(slot.pending)
        at = slot.pos(slot.n_past)  # a text run: one position a token from there
        for k in range(take):
            plan.rows.append(BatchRow(slot.pending[k], at + k, slot.seq_id,
                                      last_chunk and k == take - 1))
        if last_chunk:
            plan.sample_at[slot.seq_id] = len(plan.rows) - 1
        plan.prefill.append((slot, take))
        attended += take * slot.n_past + take * (take + 1) // 2
    return plan


def text_run(pending: list[int], limit: int) -> int:
    """How many of the pending tokens, at most `limit`, come before the next image
    (a negative placeholder id, runner.llama.vision)."""
    n = min(limit, len(pending))
    for i in range(n):
        if pending[i] < 0:
            return i
    return n
