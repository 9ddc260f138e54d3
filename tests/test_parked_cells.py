"""No cell outlives its owner: after every way an infill's parked run ends, the scratch
sequence and each slot hold in llama.cpp's KV exactly the cells they claim. Read from
the KV itself (llama_memory_seq_pos_max), with the engine at rest.

A keystroke before a cached suffix parks the suffix's cells on the scratch sequence
while the typed tokens decode (runner.engine.schedule). Editors cancel on almost every
keystroke, so the run often ends parked, with nothing else running: its cells must go
then, not at the next busy step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import llama_cpp as L
import pytest

from corral.runner.engine.engine import Engine
from corral.runner.engine.plan import Park, StepPlan
from corral.runner.jobs import Done, Failed, Job, SamplingParams, Token
from corral.runner.llama.context import EngineConfig
from tests.support import wait_for
from tests.test_infill import STORY_END, fim_ggufs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.model
DEADLINE = 300.0


class CancelWhenParked:
    """A step seam: cancels the current job at the first step its run is parked in, and
    counts the steps that parked a run (a Park op) and the runs it cancelled parked."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.job: Job | None = None
        self.cancelled = 0
        self.parks = 0

    def __call__(self, plan: StepPlan) -> None:
        self.parks += any(isinstance(op, Park) for op in plan.ops)
        if self.engine is not None and self.engine.schedule.parking.run is not None \
                and self.job is not None and not self.job.cancelled.is_set():
            self.job.cancel()
            self.cancelled += 1


def held(engine: Engine) -> dict[str, int]:
    """What the KV holds (the last position + 1) and what the slots claim, at rest."""
    wait_for(lambda: engine.status()["busy_slots"] == 0 and engine.status()["waiting"] == 0
             and engine.watch.running_for() == 0
             and not engine.schedule.parking.pending(), DEADLINE)
    mem = engine.llama.mem
    seen = {f"slot{s.seq_id}": L.llama_memory_seq_pos_max(mem, s.seq_id) + 1
            for s in engine.slots}
    claimed = {f"slot{s.seq_id}": s.n_past for s in engine.slots}
    if engine.llama.scratch is not None:
        seen["scratch"] = L.llama_memory_seq_pos_max(mem, engine.llama.scratch) + 1
        claimed["scratch"] = 0 if engine.schedule.parking.run is None else -1
    assert seen == claimed, (seen, claimed)
    return seen


def run(engine: Engine, hook: CancelWhenParked | None, body: list[int], suffix: list[int],
        n: int = 4, grammar: str | None = None) -> Any:
    job = Job(prompt=[7, *body, 8, *suffix, 9], reuse_chunk=16, grammar=grammar,
              params=SamplingParams(temperature=0), num_predict=n)
    if hook is not None:
        hook.job = job
    engine.submit(job)
    while isinstance(event := job.events.get(timeout=DEADLINE), Token):
        pass
    assert isinstance(event, (Done, Failed)), event
    return event


def test_a_keystroke_cancelled_while_parked_frees_the_scratch(
        fim_ggufs: dict[str, Path]) -> None:  # noqa: F811
    hook = CancelWhenParked()
    engine = Engine(str(fim_ggufs["fim"]), EngineConfig(num_ctx=1024, n_slots=1),
                    step_hook=hook)
    hook.engine = engine
    engine.start()
    try:
        assert engine.llama.scratch is not None  # one KV stream: the parking kind
        suffix = engine.tokenize(STORY_END, add_special=False)
        line = engine.tokenize("Once upon a time there was a little", add_special=False)
        more = engine.tokenize(" girl who lived", add_special=False)
        hook.job = None
        run(engine, None, line, suffix)  # the suffix is cached
        held(engine)
        run(engine, hook, line + more, suffix)  # typed; cancelled while its run is parked
        assert hook.cancelled == 1
        assert held(engine)["scratch"] == 0
    finally:
        engine.stop()


def test_a_keystroke_refused_its_sampler_frees_the_scratch(
        fim_ggufs: dict[str, Path]) -> None:  # noqa: F811
    """The run is parked in the step that makes the sampler, which a grammar that does
    not parse refuses: postprocess ends the sequence, and with nothing else to do the
    engine still plans once more, whose Drop frees the scratch sequence."""
    parks: list[StepPlan] = []
    engine = Engine(str(fim_ggufs["fim"]), EngineConfig(num_ctx=1024, n_slots=1),
                    step_hook=lambda plan: parks.extend(
                        [plan] if any(isinstance(op, Park) for op in plan.ops) else []))
    engine.start()
    try:
        suffix = engine.tokenize(STORY_END, add_special=False)
        line = engine.tokenize("Once upon a time there was a little", add_special=False)
        more = engine.tokenize(" girl who lived", add_special=False)
        run(engine, None, line, suffix)
        failed = run(engine, None, line + more, suffix, grammar="root ::= (")
        assert isinstance(failed, Failed) and len(parks) == 1  # parked, then refused
        assert held(engine)["scratch"] == 0
        done = run(engine, None, line + more, suffix)  # and the next keystroke is served
        assert isinstance(done, Done) and held(engine)["scratch"] == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("config", [{"n_slots": 1}, {"n_slots": 2, "kv_pool": 2048}],
                         ids=["one-slot", "pool"])
def test_random_editor_sessions_leave_only_claimed_cells(
        fim_ggufs: dict[str, Path], config: dict[str, int]) -> None:  # noqa: F811
    """Seeded editor sessions, 500 keystrokes in all: type, cancel while parked, move to
    another line, paste. Where there are two slots, every other session runs beside a
    long request in the other one. The KV is read at rest: after each keystroke of a
    session alone, after the session where the other slot was busy."""
    rng = random.Random(53)
    hook = CancelWhenParked()
    engine = Engine(str(fim_ggufs["fim"]), EngineConfig(num_ctx=1024, **config),
                    step_hook=hook)
    hook.engine = engine
    engine.start()
    words = [engine.tokenize(w, add_special=False) for w in
             (" girl", " who", " lived", " in", " a", " house", " by", " the", " river")]
    suffixes = [engine.tokenize(t, add_special=False) for t in
                (STORY_END, " The end.\n", "\n\ndef main():\n    pass\n")]
    story = engine.tokenize("The storm had been raging for three days", add_special=True)
    try:
        body = engine.tokenize("Once upon a time there was a little", add_special=False)
        suffix = suffixes[0]
        for session in range(50):
            busy = None
            if config["n_slots"] > 1 and session % 2:
                busy = engine.submit(Job(prompt=list(story), num_predict=48,
                                         params=SamplingParams(temperature=0)))
            for _ in range(10):
                action = rng.choice(["type", "type", "cancel", "move", "paste"])
                if action in ("type", "cancel"):
                    body = body + rng.choice(words)
                elif action == "paste":
                    body = body + [t for _ in range(3) for t in rng.choice(words)]
                else:
                    suffix = rng.choice(suffixes)
                    body = body[:rng.randrange(1, max(len(body), 2))]
                hook.job = None
                run(engine, hook if action == "cancel" else None, body[-300:], suffix,
                    n=rng.randint(1, 3))
                if busy is None:
                    held(engine)
            if busy is not None:
                while isinstance(busy.events.get(timeout=DEADLINE), Token):
                    pass
                held(engine)
    finally:
        engine.stop()
    # The sessions did what they claim: runs were parked, and cancelled while parked (a
    # change that stopped parking, or the hook's cancel, would leave nothing to check).
    assert hook.parks >= 20 and hook.cancelled >= 10, (hook.parks, hook.cancelled)
