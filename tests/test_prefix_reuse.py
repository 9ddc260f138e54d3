"""Prefix reuse stays correct after every path a slot can take.

A slot's record of cached tokens must describe its KV cache exactly, or the
next request that shares a prefix reuses KV that is not what it claims to be.
Random sequences of requests run on one slot of the real model; after each,
a fixed greedy probe must return its baseline text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from llama_cpp.llama_grammar import JSON_GBNF

from corral.errors import ContextOverflow
from corral.runner.llama.context import EngineConfig
from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Failed, Job, SamplingParams, Token
from tests.support import embed

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
PROBE = "The capital of France is"
# 1024 tokens per slot is past Gemma 3's 512-token sliding window, where a context
# shift once left KV behind that a later prefix match reused.
NUM_CTX = 1024


def run(engine: Engine, job: Job, cancel_after: int = -1) -> tuple[str, Done | Failed]:
    engine.submit(job)
    pieces = []
    while True:
        event = job.events.get(timeout=300)
        if isinstance(event, Token):
            pieces.append(event.text)
            if len(pieces) == cancel_after:
                job.cancel()
        else:
            return "".join(pieces), event


def probe(engine: Engine) -> str:
    text, end = run(engine, Job(prompt=engine.tokenize(PROBE), params=GREEDY, num_predict=10))
    assert isinstance(end, Done)
    return text


@pytest.fixture(scope="module")
def engine(starter_gguf: Path) -> Iterator[tuple[Engine, str]]:
    # Batch-invariant kernels: the probe is prefilled in other chunks than its baseline.
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=NUM_CTX, deterministic=True))
    eng.start()
    yield eng, probe(eng)
    eng.stop()


def operation(engine: Engine, kind: str, words: int) -> None:
    tok = engine.tokenize
    long_text = "word " * words
    if kind == "short":
        run(engine, Job(prompt=tok(f"Tell me about {words} cats."), params=GREEDY, num_predict=6))
    elif kind == "truncate":
        run(engine, Job(prompt=tok(long_text * 2), params=GREEDY, num_predict=4))
    elif kind == "shift":  # decoding runs past num_ctx and shifts the context
        run(engine, Job(prompt=tok("one " * (NUM_CTX - 20)), params=GREEDY, num_predict=40))
    elif kind == "cancel":
        run(engine, Job(prompt=tok(long_text), params=GREEDY, num_predict=200), cancel_after=2)
    elif kind == "grammar":
        run(engine, Job(prompt=tok("A JSON object:"), params=GREEDY, num_predict=12,
                        grammar=str(JSON_GBNF)))
    elif kind == "refused":
        _, end = run(engine, Job(prompt=tok("word " * (NUM_CTX + words)), params=GREEDY,
                                 num_predict=4, truncate=False))
        assert isinstance(end, Failed) and isinstance(end.error, ContextOverflow)
    elif kind == "embed":
        embed(engine, [tok(long_text)])


# No shrinking: each example costs seconds of real decoding, and the failing
# sequence is printed as it is.
@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["short", "truncate", "shift", "cancel", "grammar",
                                           "refused", "embed"]),
                          st.integers(min_value=50, max_value=700)), min_size=1, max_size=3))
def test_probe_keeps_its_baseline_after_any_sequence(engine: tuple[Engine, str],
                                                     ops: list[tuple[str, int]]) -> None:
    eng, baseline = engine
    for kind, words in ops:
        operation(eng, kind, words)
        assert probe(eng) == baseline, f"after {kind}({words})"


def test_the_reported_case(engine: tuple[Engine, str]) -> None:
    """Finding 3: a long prompt truncated, then shifted, then the probe again."""
    eng, baseline = engine
    operation(eng, "shift", 0)
    assert probe(eng) == baseline
