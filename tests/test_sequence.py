"""A sequence's state machine and its move between slots, without llama.cpp."""

from __future__ import annotations

import pytest

from corral.runner.jobs import Done, Job
from corral.runner.slots.sequence import DoneReason, Sequence, SeqState
from corral.runner.slots.slot import Slot, SlotState


class CountingSampler:
    freed = 0

    def free(self) -> None:
        self.freed += 1


def running(prompt: list[int], n_prefix: int = 0) -> tuple[Slot, Sequence, CountingSampler]:
    slot, seq = Slot(seq_id=3, num_ctx=64, cached=prompt[:n_prefix]), Sequence(Job(prompt))
    sampler = CountingSampler()
    slot.assign(seq, prompt[:n_prefix])
    seq.sampler = sampler  # type: ignore[assignment]
    seq.start(10, prompt, n_prefix, now=1.0)
    return slot, seq, sampler


def test_a_preempted_sequence_moves_whole_to_another_slot() -> None:
    slot, seq, sampler = running([1, 2, 3, 4], n_prefix=2)
    assert seq.pending == [3, 4] and seq.n_prompt_eval == 2 and slot.job is seq.job
    slot.cached += seq.pending
    seq.pending.clear()
    slot.transition(SlotState.DECODE)
    seq.generated += [7, 8]
    seq.n_generated, seq.t_first = 2, 1.5
    assert slot.vacate(now=2.0) is seq and slot.sequence is None
    seq.preempt()
    assert seq.state is SeqState.PREEMPTED and seq.sampler is sampler and sampler.freed == 0
    other = Slot(seq_id=5, num_ctx=64)
    other.assign(seq, [])
    seq.resume(seq.job.prompt + seq.generated, n_prefix=0)
    # The same object carries on: its progress was never copied out and back.
    assert other.sequence is seq and seq.pending == [1, 2, 3, 4, 7, 8] and seq.last_token == 8
    assert (seq.n_generated, seq.n_prompt_eval, seq.t_first) == (2, 2, 1.5)


def test_finishing_frees_the_sampler_once_and_reports() -> None:
    slot, seq, sampler = running([1, 2, 3])
    slot.vacate(now=3.0)
    seq.end(Done(seq.stats(DoneReason.STOP, now=3.0)))
    assert seq.state is SeqState.FINISHED and sampler.freed == 1 and seq.sampler is None
    event = seq.job.events.get_nowait()
    assert isinstance(event, Done) and event.stats.prompt_tokens == 3
    with pytest.raises(RuntimeError, match="illegal transition"):
        seq.finish()  # a finished sequence never finishes twice


@pytest.mark.parametrize("path", [
    [SeqState.RUNNING, SeqState.PREEMPTED, SeqState.RUNNING, SeqState.FINISHED],
    [SeqState.FINISHED],  # cancelled while queued
    [SeqState.RUNNING, SeqState.PREEMPTED, SeqState.FINISHED],  # cancelled while preempted
])
def test_legal_paths(path: list[SeqState]) -> None:
    seq = Sequence(Job([1]))
    for state in path:
        seq.transition(state)
    assert seq.state is path[-1]


@pytest.mark.parametrize("start,bad", [
    (SeqState.WAITING, SeqState.PREEMPTED), (SeqState.FINISHED, SeqState.RUNNING),
    (SeqState.PREEMPTED, SeqState.PREEMPTED), (SeqState.RUNNING, SeqState.WAITING)])
def test_illegal_transitions_are_refused(start: SeqState, bad: SeqState) -> None:
    seq = Sequence(Job([1]), state=start)
    with pytest.raises(RuntimeError, match="illegal transition"):
        seq.transition(bad)
