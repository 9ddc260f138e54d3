"""Speculative decoding on the real engine (runner.speculative, runner.engine): drafts verified in
the batch change nothing of the output. With batch-invariant kernels (deterministic) the
tokens, logprobs and done reasons are the same with and without it; without them, the
kernels' last bits between batch shapes are the one difference allowed (docs/api.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import llama_cpp as L
import pytest

from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.llama.context import EngineConfig
from corral.runner.slots.slot import SlotState
from corral.runner.speculative.ngram import NgramIndex
from corral.runner.speculative.source import History
from tests.support import FlatCost, collect, same_output

CODE = '''class Account:
    def __init__(self, balance, rate):
        self.balance = balance
        self.rate = rate
        self.history = []

    def update(self, balance):
        self.history.append(self.balance)
        self.balance = balance
        return self.balance

    def total(self):
        return sum(self.history) + self.balance * self.rate
'''
REPETITIVE = f"# account.py\n{CODE}\n\n# account.py, the same code with type hints:\n"
FREE = "The storm had been raging for three days when the old lighthouse keeper"
N = 96


@pytest.fixture(scope="module")
def engines(starter_gguf: Path) -> Iterator[dict[bool, Engine]]:
    made = {spec: Engine(str(starter_gguf), EngineConfig(
        n_slots=2, num_ctx=2048, deterministic=True, speculative=spec), cost=FlatCost())
        for spec in (True, False)}
    for e in made.values():
        e.start()
    yield made
    for e in made.values():
        e.stop()


def run(engine: Engine, prompt: str, **job: Any) -> tuple[list[Token], Done]:
    params = job.pop("params", SamplingParams(temperature=0, seed=1))
    return collect(engine.submit(Job(prompt=engine.tokenize(prompt, add_special=True),
                                     params=params, num_predict=job.pop("num_predict", N),
                                     **job)))


same = same_output


@pytest.mark.parametrize("prompt", [REPETITIVE, FREE], ids=["repetitive", "free"])
def test_greedy_output_is_the_same_with_and_without_drafts(engines: dict[bool, Engine],
                                                           prompt: str) -> None:
    on, off = run(engines[True], prompt, logprobs=2), run(engines[False], prompt, logprobs=2)
    same(on, off)
    assert off[1].stats.draft_count == 0
    if prompt is REPETITIVE:  # it writes the file again: most of it is drafted and kept
        stats = on[1].stats
        assert stats.draft_count > N // 4 and stats.draft_accepted_count > N // 4
        # A step's tokens go to the caller as one event: the same text in fewer events
        # where drafts were kept.
        assert len(on[0]) <= len(off[0]) - stats.draft_accepted_count // 2
    assert on[1].stats.draft_accepted_count <= on[1].stats.draft_count


def test_seeded_sampling_is_the_same_with_and_without_drafts(engines: dict[bool, Engine]
                                                             ) -> None:
    """A drafted token is kept only where the sampler, on the target logits at that row
    with the request's own random stream, picks it: one draw per token either way."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=1234)
    on = run(engines[True], REPETITIVE, params=params, logprobs=0)
    same(on, run(engines[False], REPETITIVE, params=params, logprobs=0))
    assert on[1].stats.draft_accepted_count > 0


def test_a_grammar_constrained_request_drafts_and_stays_in_its_grammar(
        engines: dict[bool, Engine]) -> None:
    grammar = 'root ::= ("    def " [a-z_]+ "(self" [^\\n]* "\\n")+'
    on = run(engines[True], REPETITIVE + "    def __init__", grammar=grammar)
    same(on, run(engines[False], REPETITIVE + "    def __init__", grammar=grammar))
    assert on[1].stats.draft_count > 0


def test_stop_strings_and_limits_cut_inside_a_draft(starter_gguf: Path,
                                                    engines: dict[bool, Engine]) -> None:
    """The output is plain decoding's. A stop string cuts inside a draft: one did reach
    past where the sequence ended (else this checks nothing); a limit bounds the draft
    before it is made, so none reaches past it, and at 30 drafts are kept. Every token
    a step verified counts (the step cost may cut a draft before it goes in)."""
    verified, reach = [0], []  # tokens verified; how far each verified draft reached

    def step(plan):  # type: ignore[no-untyped-def]
        for slot in plan.batch.decoding:
            draft = plan.batch.drafts.get(slot.seq_id, [])
            if draft:
                verified[0] += len(draft)
                reach.append(len(slot.sequence.history.tokens) + len(draft))

    engine = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=2048, deterministic=True),
                    step_hook=step, cost=FlatCost())
    engine.start()
    try:
        for job in ({"stop": ["self.history"]}, {"num_predict": 7}, {"num_predict": 30}):
            reach.clear()
            verified[0] = 0
            on = run(engine, REPETITIVE, **dict(job))
            same(on, run(engines[False], REPETITIVE, **dict(job)))
            # Every drafted token counts, the last draft's too (its sample ended it).
            assert on[1].stats.draft_count == verified[0] > 0, job
            if "stop" in job:
                assert max(reach) > len(on[1].stats.context)
            else:
                assert max(reach, default=0) <= len(on[1].stats.context), job
        assert on[1].stats.draft_accepted_count > 0
    finally:
        engine.stop()


class Wrong(NgramIndex):
    """Drafts a token the model will not pick: one past the one plain decoding picks
    (`truth`: the greedy continuation, known from a run without drafts)."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__()
        self.truth = truth

    def draft(self, history: History, n: int) -> list[int]:
        at = len(history.tokens) - self.prompt_len
        return [(t + 1) % 1000 for t in self.truth[at:at + n]] if n > 0 else []

    prompt_len = 0


def test_every_draft_rejected_keeps_output_and_leaves_no_cell(starter_gguf: Path,
                                                              engines: dict[bool, Engine]
                                                              ) -> None:
    tokens, done = run(engines[False], REPETITIVE)
    prompt = engines[False].tokenize(REPETITIVE, add_special=True)
    truth = list(done.stats.context[len(prompt):])
    index = Wrong(truth)
    index.prompt_len = len(prompt)
    engine = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=2048, deterministic=True),
                    drafts=index, cost=FlatCost())
    engine.start()
    try:
        on = run(engine, REPETITIVE)
        same(on, (tokens, done))
        assert on[1].stats.draft_count > 0 and on[1].stats.draft_accepted_count == 0
        # Rejected drafts' cells are gone: the KV holds exactly what the slot caches, so
        # the prompt cache can never keep a rejected token.
        slot = engine.slots[0]
        assert L.llama_memory_seq_pos_max(engine.llama.mem, 0) == len(slot.cached) - 1
    finally:
        engine.stop()


def test_two_choices_at_once_draft_from_each_other(engines: dict[bool, Engine]) -> None:
    """n = 2: two sequences of one request decode side by side, drafting from the index
    they share, and each is what it is alone."""
    e = engines[True]
    prompt = e.tokenize(REPETITIVE, add_special=True)
    jobs = [e.submit(Job(prompt=list(prompt), params=SamplingParams(temperature=0, seed=1),
                         num_predict=N)) for _ in range(2)]
    outs, kept = [], []
    for job in jobs:
        text = ""
        while isinstance(event := job.events.get(timeout=300), Token):
            text += event.text
        assert isinstance(event, Done), event
        outs.append(text)
        kept.append(event.stats.draft_accepted_count)
    alone = "".join(t.text for t in run(engines[False], REPETITIVE)[0])
    assert outs == [alone, alone]
    assert all(k > 0 for k in kept), kept  # both drafted, and kept drafts


def test_undeletable_draft_cells_of_a_slot_that_just_ended_leave_it_empty(
        engines: dict[bool, Engine]) -> None:
    """The guard for a rejected draft's cells that would not go (run.trim says which):
    a slot whose sequence ended in the same step is IDLE already; it is left holding
    nothing, and the engine goes on (failing it again was an illegal transition that
    ended the engine thread)."""
    e = engines[True]
    run(e, REPETITIVE, num_predict=4)
    wait_for_rest(e)
    slot = e.slots[0]
    assert slot.state is SlotState.IDLE
    e._stuck({slot.seq_id})
    assert slot.cached == [] and slot.state is SlotState.IDLE
    assert run(e, REPETITIVE, num_predict=4)[1].stats.eval_count == 4


def wait_for_rest(e: Engine) -> None:
    from tests.support import wait_for

    wait_for(lambda: e.status()["busy_slots"] == 0 and e.status()["waiting"] == 0
             and e.watch.running_for() == 0, 300)
