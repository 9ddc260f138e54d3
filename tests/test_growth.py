"""Elastic KV: the capacity policy as a pure state machine, and growth and shrink with
the real model, outputs unchanged (deterministic mode, greedy)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from corral.runner.kv.growth import Capacity, GrowthState, tier


def test_tiers_are_powers_of_two_within_start_and_cap() -> None:
    assert [tier(n, 1, 16) for n in (0, 1, 2, 3, 5, 9, 16, 40)] == [1, 1, 2, 4, 8, 16, 16, 16]
    assert tier(3, 1, 6) == 4 and tier(5, 1, 6) == 6 and tier(1, 2, 8) == 2


def test_one_step_covers_a_burst_and_nothing_builds_twice() -> None:
    c = Capacity(start=1, cap=16)
    assert c.want(busy=1, waiting=0, now=0) is None  # one fits the idle size
    assert c.want(busy=1, waiting=15, now=1) == 16  # a burst of sixteen: one step
    assert c.state is GrowthState.BUILDING and c.want(busy=1, waiting=15, now=1) is None
    c.built(now=2)
    assert c.streams == 16 and c.state is GrowthState.STEADY
    assert c.want(busy=16, waiting=4, now=3) is None  # at the cap: requests wait


def test_shrink_waits_for_a_quiet_spell_then_halves_or_more() -> None:
    c = Capacity(start=1, cap=16, streams=16, shrink_after=30)
    assert c.want(busy=9, waiting=0, now=100) is None  # above half: in use
    assert c.want(busy=3, waiting=0, now=110) is None  # quiet, but not for long
    assert c.want(busy=3, waiting=0, now=129) is None
    assert c.want(busy=3, waiting=0, now=131) == 4  # quiet for 30 s: down to what runs
    c.built(now=131)
    assert c.want(busy=0, waiting=0, now=150) is None
    assert c.want(busy=0, waiting=0, now=162) == 1  # idle: back to one sequence's KV


def test_a_failed_build_caps_growth_where_it_is() -> None:
    c = Capacity(start=1, cap=16)
    assert c.want(busy=1, waiting=3, now=0) == 4
    c.failed()
    assert c.cap == 1 and c.streams == 1 and c.want(busy=1, waiting=3, now=1) is None


def test_warm_conversations_keep_a_stream_each_until_quiet() -> None:
    c = Capacity(start=1, cap=16, shrink_after=30)
    # Warm: a prefix worth keeping, used within half the shrink window.
    assert c.warm(cached=1000, last_used=100, now=110)
    assert not c.warm(cached=1000, last_used=100, now=116) and not c.warm(10, 100, 101)
    # A second conversation overwrote the first's warm prefix: a stream more.
    assert c.want(busy=1, waiting=0, now=100, warm=2) == 2
    c.built(now=100)
    assert c.want(busy=1, waiting=0, now=101, warm=2) is None  # both fit now
    assert c.want(busy=0, waiting=0, now=115, warm=2) is None  # still alternating
    assert c.want(busy=0, waiting=0, now=144, warm=0) is None  # quiet, not for long
    assert c.want(busy=0, waiting=0, now=146, warm=0) == 1  # quiet for 30 s: one stream


def test_on_the_reserve_the_streams_stay_while_more_than_one_is_in_use() -> None:
    c = Capacity(start=1, cap=16, streams=16, shrink_after=30, on_reserve=True)
    assert c.want(busy=1, waiting=0, now=100, warm=3) is None  # 3 of 16: kept, costs nothing
    assert c.want(busy=0, waiting=0, now=129, warm=3) is None
    assert c.want(busy=0, waiting=0, now=140, warm=1) is None  # one: quiet from here
    assert c.want(busy=0, waiting=0, now=160, warm=1) == 1


class _Reserve:
    streams = 16

    def __init__(self) -> None:
        self.made = True

    def ready(self) -> bool:
        return self.made

    def take(self) -> str:
        self.made = False
        return "the reserve's context"


def test_growth_of_any_size_takes_the_reserve_and_warmth_needs_one() -> None:
    import queue

    from corral.runner.kv.growth import Resizer

    posted: queue.Queue[object] = queue.Queue()
    grows = Resizer(None, Capacity(start=1, cap=16), posted.put, _Reserve())  # type: ignore[arg-type]
    grows.tick(busy=1, waiting=0, now=0, warm=2)
    resized = posted.get(timeout=30)
    assert (resized.ctx, resized.streams) == ("the reserve's context", 16)  # type: ignore[attr-defined]
    # Without a reserve, warm conversations share one stream (a GPU's KV is committed).
    stays = Resizer(None, Capacity(start=1, cap=16), posted.put, None)  # type: ignore[arg-type]
    stays.tick(busy=1, waiting=0, now=0, warm=3)
    assert stays.capacity.state is GrowthState.STEADY and posted.empty()


class _SlowBuild:
    """A model's context maker whose build waits for the test: the engine stops meanwhile."""

    def __init__(self) -> None:
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        self.discarded: list[str] = []

    def new_context(self, streams: int) -> str:
        self.started.set()
        assert self.release.wait(30)
        return f"a context of {streams}"

    def discard(self, ctx: str) -> None:
        self.discarded.append(ctx)


def test_a_stop_waits_for_a_build_under_way_and_frees_what_it_made() -> None:
    """The model is freed after a stop: a context still being made from it then would
    abort the process. The stop waits for the build, and its context is freed, not
    posted to an engine that is gone."""
    import queue
    import threading

    from corral.runner.kv.growth import Resizer

    posted: queue.Queue[object] = queue.Queue()
    llama = _SlowBuild()
    resizer = Resizer(llama, Capacity(start=1, cap=4), posted.put)  # type: ignore[arg-type]
    resizer.tick(busy=3, waiting=0, now=0)
    assert llama.started.wait(30)
    freed: list[bool] = []
    stop = threading.Thread(target=lambda: freed.append(resizer.free()))
    stop.start()
    stop.join(0.05)
    assert not freed  # still waiting for the build
    llama.release.set()
    stop.join(30)
    assert freed == [True] and llama.discarded == ["a context of 4"] and posted.empty()


def test_a_build_posted_but_never_applied_is_freed_at_the_stop() -> None:
    """The engine's loop ended before it read the new context: the stop frees it."""
    import queue

    from corral.runner.kv.growth import Resizer

    posted: queue.Queue[object] = queue.Queue()
    llama = _SlowBuild()
    llama.release.set()
    resizer = Resizer(llama, Capacity(start=1, cap=4), posted.put)  # type: ignore[arg-type]
    resizer.tick(busy=2, waiting=0, now=0)
    assert posted.get(timeout=30).ctx == "a context of 2"  # type: ignore[attr-defined]
    assert resizer.free() and llama.discarded == ["a context of 2"]


@pytest.fixture(scope="module")
def elastic(starter_gguf: Path) -> Iterator[object]:
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine

    eng = Engine(str(starter_gguf), EngineConfig(n_slots=4, start_slots=1, num_ctx=512,
                                                 deterministic=True))
    eng.resizer.capacity.shrink_after = 0.5  # type: ignore[union-attr]
    eng.start()
    yield eng
    eng.stop()


@pytest.mark.model
def test_growth_and_shrink_leave_greedy_outputs_unchanged(elastic: object) -> None:
    from corral.runner.engine.engine import Engine
    from tests.test_engine import PROMPTS, run, run_together

    engine = elastic
    assert isinstance(engine, Engine) and len(engine.slots) == 1
    alone = [run(engine, p, 20)[0] for p in PROMPTS]  # one at a time
    _back_to_one(engine)  # (those that came back lately may have kept a stream each)
    together = run_together(engine, [(p, 20, {}) for p in PROMPTS])
    assert together == alone and engine.status()["slots"] == 4
    _back_to_one(engine)  # idle for shrink_after: back to one stream
    assert [run(engine, p, 20)[0] for p in PROMPTS] == alone


def _back_to_one(engine: object) -> None:
    deadline = time.monotonic() + 30
    while engine.status()["slots"] > 1:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, engine.status()  # type: ignore[attr-defined]
        time.sleep(0.1)


@pytest.mark.model
def test_a_sequence_carries_on_across_a_growth_step(elastic: object) -> None:
    from corral.runner.engine.engine import Engine
    from corral.runner.jobs import Job, Token
    from tests.test_engine import GREEDY, PROMPTS, collect, run, run_together

    engine = elastic
    assert isinstance(engine, Engine)
    solo = run(engine, PROMPTS[1], 60)[0]
    _back_to_one(engine)  # after shrink_after
    resizes = engine.resizer.resizes  # type: ignore[union-attr]
    job = engine.submit(Job(prompt=engine.tokenize(PROMPTS[1]), num_predict=60, params=GREEDY))
    first = job.events.get(timeout=60)  # it is decoding on the only stream...
    assert isinstance(first, Token)
    others = run_together(engine, [(p, 10, {}) for p in PROMPTS[:1] + PROMPTS[2:]])
    pieces, kind, _ = collect(job)  # ...and moved to a bigger context mid-stream
    assert kind == "done" and first.text + "".join(pieces) == solo
    assert engine.resizer.resizes > resizes and all(others)  # type: ignore[union-attr]


def _state(streams: int, at: int, cells: int, seq: int = 0) -> bytes:
    """A sequence's state as llama.cpp writes it: header, one section, one full stream."""
    u32 = lambda v: v.to_bytes(4, "little")  # noqa: E731
    body = b"".join(u32(p) + u32(1) + u32(seq) for p in range(cells))  # pos, one id
    body += u32(0) + u32(1)  # v_trans off, one layer
    body += u32(1) + (3).to_bytes(8, "little") + b"k" * 3 * cells  # K: type, row, rows
    body += u32(1) + (2).to_bytes(8, "little") + b"v" * 2 * cells  # V likewise
    entries = [u32(cells) + body if i == at else u32(0) for i in range(streams)]
    return u32(0xAF1424D8) + u32(seq) + u32(streams) + b"".join(entries)


def test_restream_rewrites_the_stream_count_and_nothing_else() -> None:
    from corral.runner.kv.kvbytes import restream

    one = _state(streams=1, at=0, cells=2, seq=5)
    assert restream(one, 1, 5) == one
    four = restream(one, 4, 5)
    assert four is not None and restream(four, 1, 5) == one
    assert restream(_state(4, 2, 2, seq=5), 1, 5) == one  # from the third stream of four
    # Same stream count: llama.cpp reads neither the header's sequence nor the entry's
    # place, so the state goes in as it is (no copy of tens of megabytes).
    third = _state(4, 2, 2, seq=5)
    assert restream(third, 4, 0) is third and restream(one, 1, 3) is one
    assert restream(one[:-1], 4, 5) is None  # cut short: refused, never misread
    assert restream(one + b"\0", 4, 5) is None
