"""A placement that fails at run (its sampler refused, its prefix not restored) leaves
out its own rows only: the other streams' rows of that step decode as planned."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.runner.engine.engine import Engine
from corral.runner.engine.plan import StepPlan
from corral.runner.jobs import Done, Failed, Job, SamplingParams, Token
from corral.runner.llama.context import EngineConfig

pytestmark = pytest.mark.model
DEADLINE = 300.0


class Watch:
    """A step seam: notes how many tokens the engine had sampled when each step began,
    and which steps placed the refused job."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.bad: Job | None = None
        self.sampled: list[int] = []
        self.placed_bad: list[int] = []

    def __call__(self, plan: StepPlan) -> None:
        assert self.engine is not None
        if any(p.seq.job is self.bad for p in plan.placed):
            self.placed_bad.append(len(self.sampled))
        self.sampled.append(self.engine.sampled)


def test_a_refused_sampler_does_not_hold_back_the_other_stream(starter_gguf: Path) -> None:
    watch = Watch()
    engine = Engine(str(starter_gguf), EngineConfig(n_slots=2, num_ctx=512,
                                                    speculative=False), step_hook=watch)
    watch.engine = engine
    engine.start()
    try:
        prompt = engine.tokenize("Once upon a time", add_special=True)
        running = engine.submit(Job(prompt=list(prompt), num_predict=40,
                                    params=SamplingParams(temperature=0)))
        assert isinstance(running.events.get(timeout=DEADLINE), Token)  # decoding
        watch.bad = Job(prompt=list(prompt), num_predict=4, grammar="root ::= (",
                        params=SamplingParams(temperature=0))
        engine.submit(watch.bad)
        assert isinstance(watch.bad.events.get(timeout=DEADLINE), Failed)
        while isinstance(event := running.events.get(timeout=DEADLINE), Token):
            pass
        assert isinstance(event, Done) and event.stats.eval_count == 40
        [at] = watch.placed_bad
        # The step that refused the sampler still sampled the running stream's token.
        assert watch.sampled[at + 1] > watch.sampled[at]
    finally:
        engine.stop()
