"""The engine's step planning, without llama.cpp: who goes into the next batch, and where."""

from __future__ import annotations

import subprocess
import sys

from corral.runner.engine.batchplan import BatchRow, plan_step
from corral.runner.jobs import Job
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot, SlotState


def slot(seq: int, state: SlotState, *, cached: int = 0, pending: int = 0,
         started: float = 0.0) -> Slot:
    s = Slot(seq_id=seq, num_ctx=4096)
    if state is SlotState.IDLE:
        s.cached = list(range(cached))
        return s
    prompt = list(range(100 * seq, 100 * seq + cached + pending))
    s.cached = prompt[:cached]
    seq_ = Sequence(Job(prompt=prompt))
    s.assign(seq_, prompt[:cached])
    seq_.start(10, prompt, cached, now=started)
    if state is SlotState.DECODE:
        s.cached, seq_.pending = prompt, []
        s.transition(SlotState.DECODE)
        seq_.last_token = 7 + seq
    return s


def test_decoding_slots_go_first_each_with_logits() -> None:
    slots = [slot(0, SlotState.DECODE, cached=5), slot(1, SlotState.PREFILL, pending=3),
             slot(2, SlotState.DECODE, cached=9)]
    plan = plan_step(slots, n_batch=16)
    assert plan.rows[:2] == [BatchRow(7, 5, 0, True), BatchRow(9, 9, 2, True)]
    assert plan.rows[2:] == [BatchRow(100, 0, 1, False), BatchRow(101, 1, 1, False),
                             BatchRow(102, 2, 1, True)]
    assert plan.sample_at == {0: 0, 2: 1, 1: 4}
    assert [s.seq_id for s in plan.decoding] == [0, 2] and plan.prefill == [(slots[1], 3)]


def test_a_prompt_token_taken_back_is_read_again_before_the_next_token() -> None:
    """A prompt's last token its memory took back for a checkpoint (Schedule._retakes)
    goes in the row before the sampled token's, without logits; the draft after them,
    and a batch too small for both rows leaves the slot for the next step."""
    taken = slot(0, SlotState.DECODE, cached=5)
    taken.cached.pop()
    taken.pending.append(4)  # the sequence's
    other = slot(1, SlotState.DECODE, cached=3)
    plan = plan_step([taken, other], n_batch=16, drafts={0: [50, 51]})
    assert plan.rows[:4] == [BatchRow(4, 4, 0, False), BatchRow(7, 5, 0, True),
                             BatchRow(50, 6, 0, True), BatchRow(51, 7, 0, True)]
    assert plan.rows[4:] == [BatchRow(8, 3, 1, True)]
    assert plan.sample_at == {0: 1, 1: 4} and plan.drafts == {0: [50, 51]}
    tight = plan_step([other, taken], n_batch=2)
    assert tight.rows == [BatchRow(8, 3, 1, True)] and tight.decoding == [other]


def test_long_prompt_is_chunked_and_samples_only_on_its_last_chunk() -> None:
    long = slot(1, SlotState.PREFILL, cached=2, pending=40)
    running = slot(0, SlotState.DECODE, cached=3)
    plan = plan_step([running, long], n_batch=8)
    assert len(plan.rows) == 8
    assert [row.pos for row in plan.rows[1:]] == list(range(2, 9))  # continues after the cache
    assert not any(row.logits for row in plan.rows[1:])
    assert 1 not in plan.sample_at and plan.prefill == [(long, 7)]
    assert plan.sample_at == {0: 0}  # the running stream still advances this step


def test_older_requests_prefill_first_within_the_budget() -> None:
    young = slot(1, SlotState.PREFILL, pending=5, started=2.0)
    old = slot(2, SlotState.PREFILL, pending=5, started=1.0)
    plan = plan_step([young, old], n_batch=7)
    assert plan.prefill == [(old, 5), (young, 2)]
    assert plan.sample_at == {2: 4}


def test_idle_slots_and_a_full_batch_add_nothing() -> None:
    assert plan_step([slot(0, SlotState.IDLE, cached=4)], n_batch=8).rows == []
    decoding = [slot(i, SlotState.DECODE, cached=1) for i in range(3)]
    waiting = slot(3, SlotState.PREFILL, pending=4)
    plan = plan_step(decoding + [waiting], n_batch=3)
    assert len(plan.rows) == 3 and plan.prefill == []


def test_planning_needs_no_llama_cpp() -> None:
    # The step's policies are pure: planning, scheduling and the prompt cache's bookkeeping.
    code = ("import sys, corral.runner.engine.batchplan, corral.runner.engine.placer, "
            "corral.runner.cache.promptcache; sys.exit('llama_cpp' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_tails_over_a_long_context_go_a_few_per_step_short_prompts_all_at_once() -> None:
    from corral.runner.engine.batchplan import ATTEND_BUDGET

    # Sixteen 10-token questions after a shared 1,140-token document (a burst, again).
    tails = [slot(i, SlotState.PREFILL, cached=1140, pending=10, started=i) for i in range(16)]
    plan = plan_step(tails, n_batch=512)
    taken = [s.seq_id for s, _ in plan.prefill]
    assert taken == list(range(len(taken))) and 2 <= len(taken) < 16  # oldest first
    assert sum(n * (1140 + 5) for _, n in plan.prefill[:-1]) < ATTEND_BUDGET
    assert sorted(plan.sample_at) == taken  # each taken tail is whole: its first token
    # Sixteen 32-token prompts at an empty context: batching pays, one step takes all.
    fresh = [slot(i, SlotState.PREFILL, pending=32, started=i) for i in range(16)]
    assert len(plan_step(fresh, n_batch=512).prefill) == 16
    # A long prompt alone still fills the batch.
    assert plan_step([slot(0, SlotState.PREFILL, cached=1140, pending=900)],
                     n_batch=512).prefill[0][1] == 512


def test_a_batch_without_some_sequences_keeps_the_others_rows_and_logits() -> None:
    slots = [slot(0, SlotState.DECODE, cached=5), slot(1, SlotState.PREFILL, pending=3),
             slot(2, SlotState.DECODE, cached=9), slot(3, SlotState.PREFILL, pending=2)]
    plan = plan_step(slots, n_batch=16, drafts={2: [1, 2]})
    rest = plan.without({0, 1})
    assert rest.rows == [r for r in plan.rows if r.seq_id in (2, 3)]
    assert rest.sample_at == {2: 0, 3: 4} and rest.drafts == {2: [1, 2]}
    assert [s.seq_id for s in rest.decoding] == [2] and rest.prefill == [(slots[3], 2)]
