"""The n-gram index speculation drafts from, and the draft policy: pure, no llama.cpp."""

from __future__ import annotations

import random
import subprocess
import sys

from corral.runner.speculative import policy
from corral.runner.speculative.cost import Offer
from corral.runner.speculative.ngram import NgramIndex
from corral.runner.speculative.source import History, Want
from corral.runner.speculative.policy import DraftPolicy


def test_a_sequence_drafts_what_followed_its_last_tokens_before() -> None:
    index = NgramIndex(k=3)
    h = History([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3])
    index.add(h)
    assert index.draft(h, 4) == [4, 5, 6, 7]
    assert index.draft(h, 2) == [4, 5]
    assert index.draft(h, 0) == []
    # The key at the very end has no continuation yet: it is not its own match.
    h2 = History([8, 8, 8, 1, 2])
    index.add(h2)
    assert index.draft(h2, 3) == []


def test_a_loop_drafts_past_its_own_end() -> None:
    # The latest "1 2 3" is one period back: its continuation runs to the end of the
    # sequence, and the draft goes on from its own last tokens, period after period.
    index = NgramIndex(k=3)
    h = History([9, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3])
    index.add(h)
    assert index.draft(h, 10) == [4, 1, 2, 3, 4, 1, 2, 3, 4, 1]
    # Where nothing followed the draft's last tokens, it stops there.
    h2 = History([5, 6, 7, 8, 5, 6, 7])
    index.add(h2)
    assert index.draft(h2, 10) == [8, 5, 6, 7, 8, 5, 6, 7, 8, 5]  # a loop too
    h3 = History([20, 21, 22, 23, 24, 20, 21, 22])
    index.add(h3)
    assert index.draft(h3, 3) == [23, 24, 20]


def test_the_latest_occurrence_wins_and_continuations_grow() -> None:
    index = NgramIndex(k=2)
    h = History([1, 2, 3, 1, 2, 4, 1, 2])
    index.add(h)
    assert index.draft(h, 1) == [4]  # the later "1 2" went on with 4
    h.tokens += [4, 5, 6]  # what it generated
    index.add(h)
    h.tokens += [1, 2]
    assert index.draft(h, 3) == [4, 5, 6]  # read from the same list, as it grew
    assert h.indexed == 11  # the next add starts where this one stopped


def test_drafts_cross_sequences() -> None:
    """A request drafts from another's tokens: sixteen over one document, or a turn that
    quotes an earlier request's answer."""
    index = NgramIndex(k=3)
    first = History([10, 11, 12, 13, 14, 15, 16])
    index.add(first)
    second = History([99, 11, 12, 13])
    index.add(second)
    assert index.draft(second, 3) == [14, 15, 16]


def test_image_placeholders_are_neither_keys_nor_drafts() -> None:
    index = NgramIndex(k=2)
    h = History([1, 2, -5, -5, 3, 1, 2])
    index.add(h)
    assert index.draft(h, 4) == []  # "1 2" went on with an image: no draft through it
    assert len(index) == 2  # (1, 2) and (3, 1): keys holding a placeholder are not kept
    h2 = History([-5, 3, 7, 8, -5, -5, 3, 7])
    index.add(h2)
    assert index.draft(h2, 5) == [8]  # stops at the placeholder


def test_an_index_built_a_token_at_a_time_equals_one_built_at_once() -> None:
    """Prompts are indexed whole, in C loops, and tokens one by one as they decode: the
    latest continuation of a key wins either way, and a placeholder anywhere in what is
    added keeps its keys out."""
    rng = random.Random(5)
    for _ in range(50):
        tokens = [rng.choice([-1, 1, 2, 3, 4]) if rng.random() < 0.1 else rng.randint(1, 4)
                  for _ in range(rng.randint(0, 40))]
        whole, steps = NgramIndex(k=3), NgramIndex(k=3)
        a, b = History(list(tokens)), History([])
        whole.add(a)
        for t in tokens:
            b.tokens.append(t)
            steps.add(b)
        assert {key: at for key, (_, at) in whole._next.items()} == \
            {key: at for key, (_, at) in steps._next.items()}
        assert all(whole.draft(History(tokens[:i]), 4) == steps.draft(History(tokens[:i]), 4)
                   for i in range(len(tokens)))


def test_a_full_index_starts_over() -> None:
    index = NgramIndex(k=2, limit=5)
    h = History(list(range(100)))
    index.add(h)
    assert len(index) == 0
    h.tokens += [0, 1]
    index.add(h)
    assert 0 < len(index) <= 5


def test_the_index_starts_over_past_its_tokens_too() -> None:
    """Each entry keeps its sequence's history alive: past a budget of tokens indexed,
    however few keys they made, the index lets them all go."""
    index = NgramIndex(k=2, tokens=50)
    for _ in range(2):
        index.add(History([7] * 20))  # one key between them, twenty tokens each
    assert len(index) == 1
    index.add(History([7] * 20))  # sixty tokens: over the budget
    assert len(index) == 0


def test_a_hash_collision_never_makes_a_draft() -> None:
    """The key is compared where the index points: a colliding entry drafts nothing."""
    index = NgramIndex(k=2)
    a = History([1, 2, 3])
    index.add(a)
    b = History([5, 6])
    # Force b's key to point at a's entry, as a colliding hash would.
    index._next[hash((5, 6))] = (a, 2)
    assert index.draft(b, 2) == []


def test_the_policy_grows_on_success_and_shrinks_on_a_cut() -> None:
    p = DraftPolicy()
    assert p.want(decoding=1, room=1000) == policy.START
    p.verified(policy.START, policy.START)
    assert p.want(1, 1000) == policy.START * 2
    for _ in range(5):
        p.verified(p.length, p.length)
    assert p.want(1, 1000) == policy.MAX
    p.verified(policy.MAX, 3)  # the text turned after three
    assert p.want(1, 1000) == 5
    assert p.misses == 0 and p.wait == 0
    assert p.drafted == policy.START + 16 + 32 * 5 and p.accepted == p.drafted - 29


def test_misses_back_off_and_a_hit_resumes() -> None:
    p = DraftPolicy()
    waits = []
    for _ in range(9):
        drafted = p.want(1, 1000)
        assert drafted > 0
        p.verified(drafted, 0)
        skipped = 0
        while p.want(1, 1000) == 0:  # the steps it waits, then one it would draft at
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 8, 16, 32, 64, 64, 64]
    assert p.length == policy.MIN
    p.verified(2, 1)
    assert p.misses == 0 and p.wait == 0 and p.length == policy.MIN


def test_a_busy_batch_drafts_less_and_room_caps() -> None:
    p = DraftPolicy(length=policy.MAX)
    assert p.want(decoding=1, room=1000) == 32
    assert p.want(decoding=4, room=1000) == 8
    assert p.want(decoding=16, room=1000) == 2
    assert p.want(decoding=64, room=1000) == 0
    assert p.want(decoding=1, room=3) == 3
    assert p.want(decoding=1, room=0) == 0


def test_the_drafting_modules_load_without_llama_cpp() -> None:
    code = ("import sys, corral.runner.speculative.ngram, corral.runner.speculative.policy; "
            "assert 'llama_cpp' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# What a decode-only step of the base starter cost by its rows on this 2-core AVX-512
# machine (llama_decode in one unified KV, milliseconds): the repacked weights take rows
# four at a time, so a row past a multiple of four costs about a pass over the weights.
CPU_STEPS = {1: 23, 4: 34, 5: 51, 8: 53, 9: 69, 12: 66, 15: 91, 16: 84, 17: 99, 18: 104,
             20: 100, 24: 120, 32: 144, 36: 159, 40: 176, 48: 209}


def one(kept: float, n: int) -> list[Offer]:
    """One stream's draft of `n` tokens, each expected to be kept at `kept`."""
    return [Offer(1, kept, 1)] * n


def test_the_step_cost_is_learned_by_row_count_and_says_which_drafts_pay() -> None:
    """On the measured CPU curve: beside sixteen streams a few streams' drafts never pay,
    even all kept (the streams that wait through their rows pay twice: cost.BESIDE), nor
    do one stream's beside four; a stream alone takes its whole copy; fifteen streams
    take a row even at 10% (sixteen rows cost less than fifteen); four streams that all
    draft take theirs at 90%. Until a step of the streams' own rows is seen, every draft
    is taken (drafting is how the cost is learned)."""
    from corral.runner.speculative.cost import StepCost

    cost = StepCost()
    assert cost.estimate(16) is None and cost.best(16, one(0.8, 2)) == 2
    for rows, ms in CPU_STEPS.items():
        cost.observe(rows, ms / 1000)
    assert cost.estimate(16) == 0.084 and abs(cost.estimate(22) - 0.110) < 1e-9
    assert cost.best(16, one(0.8, 2)) == 0
    assert cost.best(16, one(1.0, 2) + [Offer(1, 1.0, 2)] * 2) == 0
    assert cost.best(4, one(0.9, 4)) == 0
    assert cost.best(4, [Offer(1, 0.9, 1 + i // 4) for i in range(16)]) == 16  # all four
    assert cost.best(1, one(0.95, 31)) == 31
    assert cost.best(15, one(0.1, 1)) == 1
    assert cost.best(16, one(0.1, 16)) == 0
    cost.observe(16, 0.184)  # one slow step moves the mean a fifth of the way
    assert abs(cost.estimate(16) - 0.104) < 1e-9
    cost.observe(3, 0.020, passes=2)  # a step split in two is no row count's price
    assert abs(cost.estimate(3) - (0.023 + 0.011 * 2 / 3)) < 1e-9


def test_a_count_above_those_seen_is_tried_only_where_no_stream_waits_through_it() -> None:
    """Above the largest count seen, a step where every decoding stream drafts is priced
    as the largest (tried once: trying is how its price becomes known); one where some
    would wait through it with no draft of their own by the line through the smallest
    and the largest seen, carried on. A count not seen for STALE steps is forgotten."""
    from corral.runner.speculative import cost as costs

    cost = costs.StepCost()
    cost.observe(1, 0.023)
    cost.observe(4, 0.034)
    assert abs(cost.estimate(36) - (0.034 + 0.011 / 3 * 32)) < 1e-9  # the line, carried on
    everyone = [Offer(1, 0.4, 1 + i // 8) for i in range(32)]
    assert cost.best(4, everyone) == 32  # 36 rows priced as 4: tried
    assert cost.best(4, everyone[:16]) == 0  # two of four draft: the line says no
    cost.observe(36, 0.159)  # tried: now its own price
    assert cost.best(4, everyone) == 0  # 4 + 12.8 tokens in 159 ms, not 4 in 34
    assert cost.best(4, [Offer(1, 0.9, 1 + i // 8) for i in range(32)]) == 32
    cost.observe(18, 0.300)  # a busy moment: drafting beside sixteen looks dear
    for _ in range(costs.STALE):
        cost.observe(16, 0.084)
    assert cost.estimate(18) == cost.estimate(16) == 0.084  # 18, 36 and the rest forgotten
    assert cost.best(16, [Offer(1, 0.9, 16)] * 2) == 2  # every stream drafts: tried


def test_a_sequence_expects_the_runners_rate_then_its_own() -> None:
    from corral.runner.speculative.cost import StepCost

    cost = StepCost()
    p = DraftPolicy()
    assert cost.expects(p) == cost.rate == 0.5  # a new sequence: the runner's rate
    p.verified(8, 8)
    assert cost.expects(p) == (8 + 8 * 0.5) / 16
    for _ in range(50):
        cost.verified(10, 1)
    assert abs(cost.rate - 0.1) < 0.01


def test_a_shared_buffers_drafts_are_cut_by_the_step_cost_likeliest_first() -> None:
    """Streams in one buffer on the measured CPU curve: beside sixteen, two copying
    streams' drafts do not pay for the rows the other fourteen wait through; beside four,
    the drafts of the sequences likeliest to keep them go in, cut where the rows that
    pay end (one stream waiting after misses drafts none)."""
    from corral.runner.speculative.cost import StepCost
    from corral.runner.speculative.speculation import Ask, Candidate, Speculation

    class Fixed(NgramIndex):  # a draft source that offers every sequence 2 tokens
        def draft(self, history: History, n: int) -> list[int]:
            return [7, 8][:n]

    def drafted(streams: int, missed: tuple[int, ...] = ()) -> dict[int, list[int]]:
        cost = StepCost()
        for rows, ms in CPU_STEPS.items():
            cost.observe(rows, ms / 1000)
        spec = Speculation(Fixed(), cost=cost)
        cands = []
        for seq in range(streams):
            p = DraftPolicy()
            if seq in (1, 3):  # two copying sequences
                p.verified(8, 8)
                p.verified(16, 16)
            elif seq == 2:  # one that is often right
                p.verified(8, 6)
            elif seq in missed:
                p.verified(8, 0)
                p.verified(8, 0)
            cands.append(Candidate(seq, p, History([1, 2, 3]), room=100))
        spec.prepare(Ask(cands, n_batch=512, split_equal=False))
        return spec.drafts({c.seq_id: c.history for c in cands})

    assert drafted(16) == {}
    # beside four, one waiting: 8 rows, 7.5 tokens in 53 ms and the other two's half
    # again for its wait; with the third (10 rows, 8.75 tokens) it pays less
    assert drafted(4, missed=(0,)) == {1: [7, 8], 3: [7, 8]}


def test_passes_follow_llama_cpps_sequential_equal_split() -> None:
    """Per-slot streams: a pass takes consecutive sequences, as many rows of each as the
    fewest has left (llama_batch_allocr::split_equal with sequential ids)."""
    from corral.runner.speculative.cost import passes

    assert passes([(0, 9), (1, 9), (2, 9), (3, 9)]) == 1  # every slot drafts as many
    assert passes([(0, 1), (1, 1), (2, 1), (3, 1)]) == 1
    assert passes([(0, 9), (1, 9), (2, 1), (3, 1)]) == 2  # 4 x 1, then 2 x 8
    assert passes([(0, 9), (1, 1), (2, 9), (3, 1)]) == 3  # 0 and 2 are not consecutive
    assert passes([(0, 9), (1, 9), (2, 3), (3, 1)]) == 3  # 4 x 1, 3 x 2, 2 x 6
    assert passes([(0, 1), (2, 1)]) == 2  # a gap splits even one row each


class CountingDecoder:
    """A draft model's context that predicts `last + 1`, sure of it below 100 and
    unsure from there; it records the rows it was given (the Decoder seam)."""

    def __init__(self) -> None:
        self.rows: list[list[tuple[int, int, int, bool]]] = []
        self.removed: list[tuple[int, int]] = []
        self.fail = False

    def remove(self, seq: int, start: int) -> None:
        self.removed.append((seq, start))

    def decode(self, rows):  # type: ignore[no-untyped-def]
        self.rows.append(list(rows))
        if self.fail:
            return None
        return {seq: (token + 1, 0.9 if token + 1 < 100 else 0.5)
                for token, _, seq, wanted in rows if wanted}

    def set_threads(self, n: int) -> None: ...

    def free(self) -> None: ...


def test_a_draft_model_proposes_reads_only_new_tokens_and_stops_where_unsure() -> None:
    from corral.runner.speculative.draftmodel import DraftModel

    decoder = CountingDecoder()
    model = DraftModel(decoder, n_vocab=1000, cells=56, n_max=4)
    h = History([10, 11, 12])
    # n_max bounds what the policy asks
    assert model.propose([Want(0, h, 8)]) == {0: [13, 14, 15, 16]}
    assert decoder.rows[0] == [(10, 0, 0, False), (11, 1, 0, False), (12, 2, 0, True)]
    assert len(decoder.rows) == 4  # the catch-up, then one row per token but the last
    h.tokens += [13, 14, 99]  # two kept, then the model's own token: the cells past 14 go
    assert model.propose([Want(0, h, 4)]) == {0: []}  # 100: unsure, nothing proposed
    assert decoder.removed[-1] == (0, 5) and decoder.rows[4] == [(99, 5, 0, True)]
    small = DraftModel(CountingDecoder(), n_vocab=14, cells=64)  # 14 is not the model's token
    h2 = History([11, 12])
    assert small.propose([Want(1, h2, 4)]) == {1: [13]}
    decoder.fail = True  # the cells are full: nothing now, everything read again later
    assert not any(model.propose([Want(0, h, 4)]).values()) and model.held == {}
    decoder.fail = False
    model.propose([Want(0, h, 4)])
    assert decoder.rows[-1][0] == (10, 0, 0, False)
    # Longer than the cells: it does not draft (rather than fail at every step).
    calls = len(decoder.rows)
    long = History(list(range(300, 360)))
    assert model.propose([Want(2, long, 4)]) == {} and len(decoder.rows) == calls
    # Full: a sequence that does not draft now gives its cells to one that does.
    other = History(list(range(200, 250)))
    model.propose([Want(1, other, 4)])
    assert 0 not in model.held and (0, 0) in decoder.removed and 1 in model.held


def test_a_token_past_the_draft_models_vocabulary_ends_that_sequences_drafting_only() -> None:
    """Vocabularies may differ by 128 in size: a sequence holding a token the draft model
    does not have is not fed to it (llama.cpp would refuse the batch, and every drafting
    sequence would be read again from its start); the others draft on."""
    from corral.runner.speculative.draftmodel import DraftModel

    decoder = CountingDecoder()
    model = DraftModel(decoder, n_vocab=1000, cells=64, n_max=4, n_own=900)
    fine, beyond = History([10, 11, 12]), History([20, 950, 21])
    assert model.propose([Want(0, fine, 4), Want(1, beyond, 4)]) == {0: [13, 14, 15, 16]}
    assert all(seq == 0 for rows in decoder.rows for _, _, seq, _ in rows)
    assert 1 not in model.held


def test_the_index_says_what_it_holds_and_its_bound_is_the_fits() -> None:
    from corral.runner import fitestimate
    from corral.runner.speculative import ngram

    index = NgramIndex(k=3)
    assert index.bytes() == 0
    index.add(History(list(range(100))))
    assert index.bytes() == len(index) * ngram.KEY_BYTES + 100 * ngram.TOKEN_BYTES > 0
    assert fitestimate.NGRAM_INDEX_BYTES == ngram.LIMIT * ngram.KEY_BYTES \
        + ngram.TOKENS * ngram.TOKEN_BYTES


def test_a_long_history_is_read_a_bounded_number_of_rows_a_step() -> None:
    """A new request's long prompt is read into the draft context CATCH_UP rows a step,
    like a prefill, while a short one beside it drafts at once; once read, it drafts."""
    from corral.runner.speculative import draftmodel
    from corral.runner.speculative.draftmodel import DraftModel

    decoder = CountingDecoder()
    model = DraftModel(decoder, n_vocab=100_000, cells=4096, n_max=4)
    short, long = History([10, 11, 12]), History([20 + i % 70 for i in range(600)])
    steps, drafts = 0, {}
    while 1 not in drafts:  # not read to its end yet
        calls = len(decoder.rows)
        drafts = model.propose([Want(0, short, 4), Want(1, long, 4)])
        assert len(decoder.rows[calls]) <= draftmodel.CATCH_UP  # the catch-up's decode
        assert drafts[0] == [13, 14, 15, 16]
        steps += 1
        assert steps < 10
    assert steps == -(-(600 + 3) // draftmodel.CATCH_UP)  # 603 rows in all, 256 a step
    assert drafts[1] == [60, 61, 62, 63]


def test_a_sequence_priced_out_of_drafting_drafts_again_once_it_copies() -> None:
    """One stream whose first draft missed, on a fit that a busy moment made strict: its
    drafts stop being verified, but the index's are still made and scored by the token
    that follows, so once it is seen to copy it drafts again (it used to stay off for
    the rest of the request: two runs of benchmarks/spec.py at 0.5x llama-server)."""
    from corral.runner.speculative.cost import StepCost
    from corral.runner.speculative.speculation import Ask, Candidate, Speculation

    cost = StepCost(rate=0.2)
    for rows in range(1, 33):
        cost.observe(rows, 0.010 + 0.030 * rows)  # rows priced dear: a draft must be 3/4 kept
    spec = Speculation(NgramIndex(), cost=cost)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    history = History(pattern * 3)
    spec.started(history)
    p = DraftPolicy()
    p.verified(8, 0)  # its first draft missed
    verified_at = None
    for step in range(60):
        ask = Ask([Candidate(0, p, history, room=1000)], n_batch=512, split_equal=False)
        spec.prepare(ask)
        if spec.drafts({0: history}):
            verified_at = step
            break
        spec.extended(history, pattern[len(history.tokens) % len(pattern)])
    assert verified_at is not None and verified_at > 0
    assert p.foreseen_right > 0 and p.foreseen == p.foreseen_right


def test_a_draft_models_priced_out_sequence_drafts_again_once_it_foresees() -> None:
    """The same for a draft model's candidates: priced out, a sequence still gets a
    one-token proposal, unverified, scored by the token that follows; once the draft
    model is seen to foresee it, it drafts again (it used to get no proposal, and so
    never drafted again for the rest of the request)."""
    from corral.runner.speculative.cost import StepCost
    from corral.runner.speculative.draftmodel import DraftModel
    from corral.runner.speculative.speculation import Ask, Candidate, Speculation

    cost = StepCost(rate=0.2)
    for rows in range(1, 33):
        cost.observe(rows, 0.010 + 0.030 * rows)
    decoder = CountingDecoder()
    spec = Speculation(DraftModel(decoder, n_vocab=1000, cells=512, n_max=8), cost=cost)
    history = History([10, 11, 12])
    spec.started(history)
    p = DraftPolicy()
    p.verified(8, 0)  # its first draft missed
    verified_at = None
    for step in range(60):
        for even in (False, True):  # a pool, and a KV stream per slot, alike
            ask = Ask([Candidate(0, p, history, room=1000)], n_batch=512, split_equal=even)
            spec.prepare(ask)
            if spec.drafts({0: history}):
                verified_at = step
                break
        if verified_at is not None:
            break
        spec.extended(history, history.tokens[-1] + 1)  # what the draft model foresaw
    assert verified_at is not None and verified_at > 0
    assert p.foreseen_right > 0 and p.foreseen == p.foreseen_right


def test_a_models_sequence_waiting_after_misses_drafts_again_once_it_foresees() -> None:
    """Misses in a row make a sequence wait before it drafts again (1, 2, 4, ... steps).
    A model's proposals (a draft model, an MTP head) are still made while it waits,
    unverified, and the first right one ends the wait: the text it foresees has come
    (an MTP head kept one token in six past a grammar's forced opening without this,
    benchmarks/mtp.py). The n-gram index waits its wait out."""
    from corral.runner.speculative.cost import StepCost
    from corral.runner.speculative.draftmodel import DraftModel
    from corral.runner.speculative.speculation import FORESEE, Ask, Candidate, Speculation

    def waiting(source: object) -> tuple[Speculation, DraftPolicy, History]:
        cost = StepCost(rate=0.2)
        for rows in range(1, 33):
            cost.observe(rows, 0.010 + 0.0005 * rows)  # rows cheap: drafts pay
        spec = Speculation(source, cost=cost)  # type: ignore[arg-type]
        history = History([10, 11, 12])
        spec.started(history)
        p = DraftPolicy()
        for _ in range(5):
            p.verified(8, 0)
        assert p.wait == 16
        return spec, p, history

    spec, p, history = waiting(DraftModel(CountingDecoder(), n_vocab=1000, cells=512, n_max=8))
    steps = 0
    while not spec.drafts({0: history}):
        spec.prepare(Ask([Candidate(0, p, history, room=1000)], n_batch=512,
                         split_equal=False))
        if not spec.drafts({0: history}):  # waiting: nothing verified, a token foreseen
            spec.extended(history, history.tokens[-1] + 1)  # what the draft model foresaw
        steps += 1
        assert steps < 16
    # heard every FORESEE steps of the wait: the first right one ended it
    assert steps == FORESEE + 1 and p.foreseen_right == 1 and p.misses == 0
    assert spec.drafts({0: history})[0][0] == history.tokens[-1] + 1

    spec, p, history = waiting(NgramIndex())
    spec.prepare(Ask([Candidate(0, p, history, room=1000)], n_batch=512, split_equal=False))
    spec.extended(history, 13)
    assert p.wait == 15 and p.foreseen == 0


def test_a_prompt_is_indexed_with_the_next_drafts_not_before_its_first_token() -> None:
    """The n-gram index hears a new prompt, and each sampled token, when the next drafts
    are made (`prepare`, after the step that read it): a long prompt's first token does
    not wait for its index. The drafts are then made from all of it."""
    from corral.runner.speculative.speculation import Ask, Candidate, Speculation

    index = NgramIndex()
    spec = Speculation(index)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    history = History(pattern * 3)
    spec.started(history)
    spec.extended(history, pattern[0])
    assert len(index) == 0 and history.indexed == 0
    spec.prepare(Ask([Candidate(0, DraftPolicy(), history, room=1000)], n_batch=512,
                     split_equal=False))
    assert history.indexed == len(history.tokens) == 31 and len(index) > 0
    made = spec.drafts({0: history})[0]
    assert made and made == (pattern * 2)[1:1 + len(made)]
    # A step after which nothing decodes (a request for one token) still has it heard:
    # the waiting histories do not pile up.
    ended = History([31, 32, 33, 34, 35, 36])
    spec.started(ended)
    spec.prepare(None)
    assert ended.indexed == len(ended.tokens)
