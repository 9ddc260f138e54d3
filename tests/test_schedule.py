"""The engine step's schedule, without llama.cpp: the plan it returns holds every KV op,
the batch rows, the image slice and the ends, and the slots' bookkeeping follows it."""

from __future__ import annotations

import subprocess
import sys
from itertools import count

import numpy as np

from corral.runner.cache.caches import PrefixCaches
from corral.runner.cache.promptcache import PromptCache
from corral.runner.engine.imagefeed import SLICE
from corral.runner.engine.kvplan import reuse_moves
from corral.runner.engine.kvpool import KVPool
from corral.runner.engine.placer import Placer
from corral.runner.engine.plan import (Branch, Drop, End, Join, Move, Park, Restore, Save,
                                       Shift, StepPlan, Trim)
from corral.runner.engine.schedule import Schedule
from corral.runner.jobs import ImageSpan, Job, position
from corral.runner.slots.sequence import DoneReason, Sequence, SeqState
from corral.runner.slots.slot import Slot, SlotState
from corral.runner.speculative.ngram import NgramIndex
from corral.runner.speculative.source import History
from corral.runner.speculative.speculation import Speculation

A = list(range(100, 300))  # 200 tokens
B = list(range(500, 700))
NUM_CTX = 4096


def schedule(caches: PrefixCaches | None = None, pool: KVPool | None = None,
             can_shift: bool = True, n_batch: int = 512, scratch: int | None = None,
             index: NgramIndex | None = None) -> Schedule:
    clock = count(1)
    caches = caches or PrefixCaches(PromptCache(budget=0))
    return Schedule(Placer(NUM_CTX, caches, pool), caches, pool, NUM_CTX, n_batch, can_shift,
                    lambda: float(next(clock)), scratch=scratch,
                    spec=Speculation(index) if index is not None else None)


def drafted(s: Schedule, slots: list[Slot]) -> dict[int, list[int]]:
    """What speculation drafts for the next step of `slots` (as the engine asks it after
    a step), as the step's batch plans it."""
    assert s.spec is not None
    ask = s.ask(slots)
    assert ask is not None
    s.spec.prepare(ask)
    return s.plan(slots).batch.drafts


def decoding(seq_id: int, tokens: list[int], started: float = 0.0, **job: object) -> Slot:
    """A slot generating after `tokens`, its last one next into the batch."""
    slot = Slot(seq_id=seq_id, num_ctx=NUM_CTX)
    seq = Sequence(Job(prompt=list(tokens), **job))  # type: ignore[arg-type]
    slot.assign(seq, tokens)
    seq.start(100, tokens, len(tokens), now=started)
    seq.last_token = tokens[-1]
    slot.transition(SlotState.DECODE)
    return slot


def submit(s: Schedule, prompt: list[int], **job: object) -> Sequence:
    seq = Sequence(Job(prompt=list(prompt), **job))  # type: ignore[arg-type]
    s.placer.add(seq)
    return seq


def test_a_slot_reused_keeps_its_prefix_and_trims_the_rest() -> None:
    s = schedule()
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=A[:150] + [9, 9, 9])
    seq = submit(s, A + [1])
    plan = s.plan([slot])
    assert plan.busy and plan.ops == [Trim(0, 150)]
    assert slot.state is SlotState.PREFILL and slot.cached == A[:150]
    assert seq.state is SeqState.RUNNING and seq.pending == A[150:] + [1]
    assert seq.sampler is None and plan.placed[0].new  # run makes it
    rows = plan.batch.rows
    assert rows[0].pos == 150 and len(rows) == 51 and rows[-1].logits


def test_a_placement_with_nothing_shared_drops_the_slot() -> None:
    s = schedule()
    plan = s.plan([Slot(seq_id=0, num_ctx=NUM_CTX, cached=B[:5])])
    assert plan.ops == [] and not plan.busy  # nothing waiting: nothing to do
    submit(s, A)
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=B[:5])
    assert s.plan([slot]).ops == [Drop(0)] and slot.cached == []


def test_a_restore_saves_the_slot_it_overwrites_first() -> None:
    ram = PromptCache(budget=1 << 20)
    entry = ram.add(A, b"a")
    s = schedule(PrefixCaches(ram))
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=list(B))
    submit(s, A + [1])
    plan = s.plan([slot])
    assert plan.ops == [Save(0, B), Restore(0, len(A), b"a", entry)]
    assert slot.cached == A  # as the ops leave it


def test_a_branch_copies_from_the_donor() -> None:
    s = schedule()
    leader = decoding(0, A)
    idle = Slot(seq_id=1, num_ctx=NUM_CTX)
    submit(s, A[:150] + [7, 8])
    plan = s.plan([leader, idle])
    assert plan.ops == [Branch(1, donor=0, n_prefix=150)]
    assert idle.cached == A[:150] and [p.slot for p in plan.placed] == [idle]
    # Both advance in the step: the leader's next token, the follower's two.
    assert [(r.seq_id, r.pos) for r in plan.batch.rows] == [(0, 200), (1, 150), (1, 151)]


def test_reuse_chunks_move_before_the_trim() -> None:
    cached = A[:40] + [1] * 10 + A[40:100]  # ten tokens were cut from the prompt
    moves, n_prefix = reuse_moves(3, cached, A[:100] + [5], 40, least=16)
    assert moves == [Move(3, src=50, dst=40, n=60)] and n_prefix == 100
    s = schedule(can_shift=True)
    slot = Slot(seq_id=3, num_ctx=NUM_CTX, cached=cached)
    submit(s, A[:100] + [5], reuse_chunk=16)
    plan = s.plan([slot])
    assert plan.ops == [Move(3, 50, 40, 60), Trim(3, 100)]
    assert slot.cached == A[:100] and slot.tainted  # moved KV is approximate


def test_text_typed_before_a_cached_run_parks_it_then_joins_it() -> None:
    """A keystroke before an infill's suffix: the suffix's run waits on the scratch
    sequence (Park), the slot's rows stop where it starts again, and once they are in
    the KV the next step joins it (Join) and prefills only what follows."""
    suffix, typed = B[:40], [7, 7, 7]
    cached = A[:50] + suffix + [9]
    prompt = A[:50] + typed + suffix + [9]
    s = schedule(can_shift=True, scratch=4)
    slot = Slot(seq_id=2, num_ctx=NUM_CTX, cached=cached)
    seq = submit(s, prompt, reuse_chunk=16)
    plan = s.plan([slot])
    assert plan.ops == [Park(2, scratch=4, keep=50, src=50, dst=53, n=40), Trim(2, 50)]
    run = s.parking.run
    assert slot.cached == A[:50] and slot.tainted and run is not None
    assert (run.slot, run.seq, run.join_at, run.cells) == (slot, seq, 53, 40)
    assert [r.token for r in plan.batch.rows] == typed  # up to the join, no logits
    assert not any(r.logits for r in plan.batch.rows)
    slot.cached += typed  # what postprocess does once the batch decoded
    del seq.pending[:3]
    plan = s.plan([slot])
    assert plan.ops == [Join(2, scratch=4, at=53, n=40)]
    assert slot.cached == A[:50] + typed + suffix and seq.pending == [9]
    assert [r.token for r in plan.batch.rows] == [9] and plan.batch.rows[0].pos == 93
    assert seq.n_prompt_eval == 4 and s.parking.run is None


def test_a_parked_run_goes_with_its_sequence_and_without_a_scratch_none_parks() -> None:
    cached = A[:50] + B[:40] + [9]
    prompt = A[:50] + [7, 7] + B[:40] + [9]
    s = schedule(can_shift=True, scratch=4)
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=list(cached))
    seq = submit(s, prompt, reuse_chunk=16)
    s.plan([slot])
    seq.job.cancelled.set()
    plan = s.plan([slot])
    assert Drop(4) in plan.ops and s.parking.run is None  # the scratch sequence is free again
    assert slot.state is SlotState.IDLE
    s = schedule(can_shift=True, scratch=4, pool=KVPool(NUM_CTX))  # parked, then preempted
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=list(cached))
    preempted = submit(s, prompt, reuse_chunk=16)
    s.plan([slot])
    assert s.parking.run is not None and s.parking.cells == 40 and s.parking.free() is None
    plan = StepPlan()
    s._preempt(slot, plan)  # the pool's relief, as _fit calls it
    assert plan.ops == [Drop(0), Drop(4)] and s.parking.run is None
    assert preempted.state is SeqState.PREEMPTED
    s.moved(5)  # a resize: the new context has its own scratch sequence
    assert s.parking.free() == 5
    s = schedule(can_shift=True)  # per-slot streams: no scratch sequence
    slot = Slot(seq_id=0, num_ctx=NUM_CTX, cached=list(cached))
    submit(s, prompt, reuse_chunk=16)
    plan = s.plan([slot])
    assert plan.ops == [Trim(0, 50)] and len(plan.batch.rows) == 43


def test_a_decoding_slot_drafts_what_followed_its_last_tokens() -> None:
    index = NgramIndex(k=2)
    s = schedule(index=index)
    slot = decoding(0, A[:60] + A[:10])  # it has just written A[:10] again
    index.add(slot.sequence.history)  # type: ignore[union-attr]
    assert s.plan([slot]).batch.drafts == {}  # none made yet: the step before makes them
    assert drafted(s, [slot]) == {0: A[10:18]}  # eight, the policy's first
    slot.sequence.history.tokens.append(A[10])  # type: ignore[union-attr]
    assert s.plan([slot]).batch.drafts == {}  # made for the tokens it held then, only
    slot.sequence.history.tokens.pop()  # type: ignore[union-attr]
    s.spec.prepare(s.ask([slot]))  # type: ignore[union-attr,arg-type]
    plan = s.plan([slot])
    rows = plan.batch.rows
    assert [r.token for r in rows] == [A[9]] + A[10:18]
    assert [r.pos for r in rows] == list(range(70, 79)) and all(r.logits for r in rows)


class Proposer(NgramIndex):
    """The n-gram index, noting what each step asked of it (as a draft model is asked)."""

    def __init__(self) -> None:
        super().__init__(k=2)
        self.asked: list[tuple[int, int]] = []  # (the history's length, tokens)

    def draft(self, history: History, n: int) -> list[int]:
        self.asked.append((len(history.tokens), n))
        return super().draft(history, n)


def test_drafts_are_decided_once_for_the_rows_the_next_step_takes() -> None:
    """With a KV stream per slot every draft is cut to the shortest: while one decoding
    slot will not draft (here its policy waits after misses), none is verified, though
    the others' are made (their odds learn from them: test_an_unverified_draft_...). A
    step of the wait counts once a step; a busy batch gives each what its rows leave."""
    index = Proposer()
    s = schedule(index=index)
    drafting, waiting = decoding(0, A[:60] + A[:10]), decoding(1, B[:30])
    index.add(drafting.sequence.history)  # type: ignore[union-attr]
    waiting.sequence.draft.wait = 2  # type: ignore[union-attr]
    assert drafted(s, [drafting, waiting]) == {} and index.asked == [(70, 8)]
    assert waiting.sequence.draft.wait == 1  # type: ignore[union-attr]
    index.asked.clear()
    assert drafted(s, [drafting]) == {0: A[10:18]} and index.asked == [(70, 8)]
    pooled = schedule(index=index, pool=KVPool(NUM_CTX))  # one stream: no cut
    assert drafted(pooled, [drafting, waiting]) == {0: A[10:18]}
    assert waiting.sequence.draft.wait == 0  # type: ignore[union-attr]
    narrow = schedule(index=index, n_batch=4)  # two decode: one row spare each
    assert drafted(narrow, [drafting, waiting]) == {}  # a row spare each; B's text has none
    assert index.asked[-2:] == [(70, 1), (30, 1)]


def test_an_unverified_draft_tells_its_sequences_odds_by_the_token_that_came() -> None:
    """A sequence whose early drafts missed is not left below the bar for good (the
    four-stream runs that gained 2.6%): a draft made and not verified, because another
    slot had none, is scored by the token its sequence samples next, for no row."""
    index = NgramIndex(k=2)
    s = schedule(index=index)
    copying, other = decoding(0, A[:60] + A[:10]), decoding(1, B[:30])
    index.add(copying.sequence.history)  # type: ignore[union-attr]
    policy = copying.sequence.draft  # type: ignore[union-attr]
    policy.verified(8, 0)  # a miss: its odds fall below what four streams need
    policy.wait = 0
    spec = s.spec
    assert spec is not None
    spec.cost.observe(1, 0.030)
    spec.cost.observe(33, 0.020 + 0.010 * 33)  # a row costs a third of a step
    before = spec.cost.expects(policy)
    assert not spec._pays(policy, 2, 8)
    for token in A[10:14]:  # it copies A; B's text offers no draft, so none is verified
        assert drafted(s, [copying, other]) == {}
        spec.extended(copying.sequence.history, token)  # type: ignore[union-attr]
        spec.extended(other.sequence.history, B[0])  # type: ignore[union-attr]
    assert (policy.foreseen, policy.foreseen_right) == (4, 4)
    assert spec.cost.expects(policy) > before
    spec.extended(copying.sequence.history, B[1])  # nothing made for this token: no score
    assert policy.foreseen == 4


def test_a_full_pool_goes_without_drafts_before_it_evicts_or_preempts() -> None:
    """Draft rows are guesses given back the same step: nothing is evicted for them."""
    index = NgramIndex(k=2)
    s = schedule(pool=KVPool(size=120), index=index)
    slot = decoding(0, A[:60] + A[:10])
    index.add(slot.sequence.history)  # type: ignore[union-attr]
    idle = Slot(seq_id=1, num_ctx=NUM_CTX, cached=B[:45])  # 70 + 45 of 120 cells used
    s.spec.prepare(s.ask([slot, idle]))  # type: ignore[union-attr,arg-type]
    plan = s.plan([slot, idle])
    assert plan.batch.drafts == {} and len(plan.batch.rows) == 1
    assert plan.ops == [] and idle.cached == B[:45]


def test_a_full_slot_shifts_its_context_or_ends_with_length() -> None:
    s = schedule(can_shift=True)
    full = decoding(0, list(range(NUM_CTX)), num_keep=4)
    plan = s.plan([full])
    discard = (NUM_CTX - 4) // 2
    assert plan.ops == [Shift(0, keep=4, discard=discard, n_past=NUM_CTX)]
    assert full.n_past == NUM_CTX - discard and full.tainted
    assert plan.batch.rows[0].pos == NUM_CTX - discard
    for off in (dict(shift=False), dict()):
        s = schedule(can_shift=bool(off))
        full = decoding(0, list(range(NUM_CTX)), **off)
        seq = full.sequence
        plan = s.plan([full])
        assert plan.ops == [] and plan.batch.rows == [] and full.state is SlotState.IDLE
        assert plan.ends == [End(seq, DoneReason.LENGTH)]  # type: ignore[arg-type]


def test_a_pool_overflow_saves_and_drops_an_idle_cache_then_preempts() -> None:
    ram = PromptCache(budget=1 << 20)
    older, newer = decoding(0, B[:100], started=1.0), decoding(1, B[100:200], started=2.0)
    idle = Slot(seq_id=2, num_ctx=NUM_CTX, cached=list(A))
    # Room for both caches and one row: the idle cache goes, and the newest sequence.
    pool = KVPool(size=201)
    s = schedule(PrefixCaches(ram), pool)
    seq = newer.sequence
    plan = s.plan([older, newer, idle])
    assert plan.ops == [Save(2, A), Drop(2), Drop(1)]
    assert idle.cached == [] and newer.state is SlotState.IDLE and newer.cached == []
    assert seq is not None and seq.state is SeqState.PREEMPTED
    assert list(s.placer.waiting) == [seq] and pool.preemptions == 1 and pool.pressure
    assert [r.seq_id for r in plan.batch.rows] == [0]


def test_cancelled_jobs_end_queued_or_running() -> None:
    s = schedule()
    running = decoding(0, A)
    queued = submit(s, B)
    seq = running.sequence
    assert seq is not None
    for job in (queued.job, seq.job):
        job.cancel()
    plan = s.plan([running])
    assert plan.ends == [End(queued, DoneReason.CANCEL, stats=False), End(seq, DoneReason.CANCEL)]
    assert not s.placer.waiting and running.state is SlotState.IDLE and not plan.busy
    assert queued.state is SeqState.WAITING  # postprocess ends it (and frees its sampler)


def test_a_prompt_that_cannot_fit_ends_refused() -> None:
    s = schedule()
    seq = submit(s, list(range(NUM_CTX + 1)), truncate=False)
    plan = s.plan([Slot(seq_id=0, num_ctx=NUM_CTX)])
    assert len(plan.ends) == 1 and plan.ends[0].seq is seq and plan.ends[0].error is not None
    assert not plan.busy and not plan.placed


def test_a_slot_at_its_image_gets_a_slice_and_no_rows() -> None:
    span = ImageSpan(2, -5, np.zeros((40, 4), dtype=np.float32), non_causal=False)
    prompt = [1, 2] + [-5] * 40 + [3]
    s = schedule()
    text = decoding(1, A)
    submit(s, prompt, images=(span,))
    idle = Slot(seq_id=0, num_ctx=NUM_CTX, cached=[1, 2])
    plan = s.plan([idle, text])
    assert plan.ops == [Trim(0, 2)]
    assert plan.image is not None and plan.image.slot is idle
    assert (plan.image.offset, plan.image.count, plan.image.last) == (0, SLICE, False)
    assert [r.seq_id for r in plan.batch.rows] == [1]
    # The rest of the image: the prompt's last token follows it, so it samples nothing.
    idle.cached += idle.pending[:SLICE]
    del idle.pending[:SLICE]
    plan = s.plan([idle, text])
    assert plan.image is not None and (plan.image.offset, plan.image.count) == (SLICE, 8)
    assert not plan.image.last


def test_an_image_waits_while_the_pool_cannot_hold_it() -> None:
    span = ImageSpan(0, -5, np.zeros((40, 4), dtype=np.float32), non_causal=False)
    s = schedule(pool=KVPool(size=2 * SLICE + 1, reserve=0))
    submit(s, [-5] * 40 + [3], images=(span,))
    slot = Slot(seq_id=0, num_ctx=NUM_CTX)
    plan = s.plan([slot])
    assert plan.image is not None and plan.image.count == SLICE
    other = Slot(seq_id=1, num_ctx=NUM_CTX, cached=list(range(SLICE + 2)))  # cells in use
    assert s.plan([slot, other]).image is None


def test_a_plan_with_nothing_busy_runs_nothing() -> None:
    plan = schedule().plan([Slot(seq_id=0, num_ctx=NUM_CTX)])
    assert plan == StepPlan()


def test_the_schedule_needs_no_llama_cpp() -> None:
    code = ("import sys, corral.runner.engine.schedule, corral.runner.engine.kvplan, "
            "corral.runner.engine.plan, corral.runner.engine.imagefeed; "
            "sys.exit('llama_cpp' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_insertion_search_tries_a_bounded_number_of_starts() -> None:
    """A cached suffix that is one token over and over (blank lines), behind typed text
    that keeps nearly matching it: each position tries at most MAX_STARTS starts, not
    every occurrence, and the search still finds where the run starts again."""
    from corral.runner.engine import kvplan

    calls = 0

    def counted(cached: list[int], c: int, tokens: list[int], p: int, end: int) -> int:
        nonlocal calls
        calls += 1
        return kvplan._run(cached, c, tokens, p, end)

    least = 16
    cached = [1, 2] + [5] * 3000 + [9]
    # Typed: runs of 5 one short of `least`, broken by 7, then the suffix again.
    typed = ([5] * (least - 1) + [7]) * 20
    tokens = [1, 2, 3, *typed, *([5] * 3000), 9, 4]
    found = kvplan._insertion(cached, 2, tokens, 2, len(tokens) - 1, least, run=counted)
    assert found is not None and found[0] == 3 + len(typed) and found[2] >= least
    assert calls <= kvplan.MAX_STARTS * (len(typed) + 1)


def test_an_mrope_image_keeps_positions_apart_from_tokens() -> None:
    # 40 tokens on a 10 x 4 grid: 10 positions. Text after it continues at 2 + 10.
    span = ImageSpan(2, -5, np.zeros((40, 4), dtype=np.float32), non_causal=False, n_pos=10,
                     grid=(10, 4))
    prompt = [1, 2] + [-5] * 40 + [3, 4, 5]
    assert [position((span,), i) for i in (0, 2, 30, 41, 42, 44, 45)] == \
        [0, 2, 2, 2, 12, 14, 15]
    s = schedule()
    submit(s, prompt, images=(span,))
    # A cached prefix that ends inside the image is cut back to its start: its tokens
    # share one position, which no cut of the KV can split.
    idle = Slot(seq_id=0, num_ctx=NUM_CTX, cached=prompt[:20])
    plan = s.plan([idle])
    assert plan.ops == [Trim(0, 2)] and plan.image is not None and plan.image.offset == 0
    # Past the image, a prefix cut and the text's rows are at positions, not indices.
    s = schedule()
    submit(s, prompt, images=(span,))
    idle = Slot(seq_id=0, num_ctx=NUM_CTX, cached=prompt[:43] + [9, 9])
    plan = s.plan([idle])
    assert plan.ops == [Trim(0, 13)]  # 43 tokens, 13 positions
    assert [(r.token, r.pos) for r in plan.batch.rows] == [(4, 13), (5, 14)]
    assert idle.pos(len(prompt)) == 15


def test_a_restore_past_an_mrope_image_cuts_at_its_position() -> None:
    span = ImageSpan(1, -5, np.zeros((40, 4), dtype=np.float32), non_causal=False, n_pos=10,
                     grid=(10, 4))
    prompt = [1] + [-5] * 40 + list(range(2, 40))
    caches = PrefixCaches(PromptCache(budget=1 << 20))
    caches.save(prompt[:70] + [99, 98], b"state")
    s = schedule(caches)
    submit(s, prompt, images=(span,))
    plan = s.plan([Slot(seq_id=0, num_ctx=NUM_CTX)])
    [restore] = [op for op in plan.ops if isinstance(op, Restore)]
    assert restore.n_prefix == 70 and restore.cut == 70 - 30  # the image saved 30 positions


def test_a_retry_inside_an_mrope_image_starts_it_again() -> None:
    from corral.runner.engine.kvops import _rewind

    span = ImageSpan(2, -5, np.zeros((40, 4), dtype=np.float32), non_causal=False, n_pos=10,
                     grid=(10, 4))
    prompt = [1, 2] + [-5] * 40 + [3]
    s = schedule()
    submit(s, prompt, images=(span,))
    slot = Slot(seq_id=0, num_ctx=NUM_CTX)
    s.plan([slot])
    slot.cached += slot.pending[:SLICE]  # one slice decoded, then a decode failed
    del slot.pending[:SLICE]
    _rewind(slot)  # its cells all sit at the image's first position: none can be kept
    assert slot.cached == [1, 2] and slot.pending == prompt[2:] and slot.pos(2) == 2
