"""A hybrid model (recurrent layers beside attention) on the engine, a tiny random LFM2
the tests write (tests/hybrid_model.py): its memory cannot be cut back, so speculation
stays off and a slot whose tokens a prompt keeps only in part is read again whole, with
the answer a fresh slot gives. (Issue 67 brings checkpoints and rollback to such models;
this is what they start from.)"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.llama.context import EngineConfig

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def hybrid_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hybrid_model import write_hybrid

    return write_hybrid(chat_gguf, tmp_path_factory.mktemp("hybrid") / "lfm2.gguf")


@pytest.fixture(scope="module")
def engine(hybrid_gguf: Path) -> Iterator[Engine]:
    made = Engine(str(hybrid_gguf), EngineConfig(n_slots=1, num_ctx=1024, deterministic=True))
    made.start()
    yield made
    made.stop()


def run(engine: Engine, prompt: list[int], n: int) -> Done:
    done = engine.submit(Job(prompt=prompt, params=SamplingParams(temperature=0, seed=1),
                             num_predict=n, ignore_eos=True))
    while isinstance(event := done.events.get(timeout=300), Token):
        pass
    assert isinstance(event, Done), event
    return event


def test_a_hybrid_memory_cannot_take_back_drafts(engine: Engine) -> None:
    assert not engine.llama.can_rollback and engine.spec is None


def test_a_prompt_that_keeps_part_of_the_slot_is_read_again(engine: Engine) -> None:
    prompt = engine.tokenize(PROMPT, add_special=True)
    tokens = list(run(engine, prompt, 16).stats.context)
    assert tokens[:len(prompt)] == prompt and len(tokens) == len(prompt) + 16
    again = tokens[:-3] + [tokens[-1]]  # all but the last three, and a token of its own
    kept = run(engine, again, 12)
    assert kept.stats.prompt_eval_count == kept.stats.prompt_tokens == len(again)
    run(engine, prompt[:2], 1)  # the slot now holds something else
    fresh = run(engine, again, 12)
    assert fresh.stats.context == kept.stats.context
