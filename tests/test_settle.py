"""A shared KV buffer settles when quiet (runner.kv.settle): the pages a burst wrote go
back, the most recent conversation stays in the first cells, the others go to the
prompt cache, and each comes back from where it went."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import wait_for

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs madvise")
MiB = 1 << 20


@linux
@pytest.mark.model
def test_a_quiet_shared_buffer_gives_back_what_a_burst_wrote(starter_gguf: Path) -> None:
    from corral.runner.engine.engine import Engine
    from corral.runner.kv.reserve import possible
    from corral.runner.kv.settle import SLACK, SettleState
    from corral.runner.llama.context import EngineConfig
    from tests.test_engine import PROMPTS, run, run_together

    assert possible(), "ggml is not built by install.sh: its clear writes every page"
    # 4 x 2,048 cells of the base starter in one buffer: ~150 MB, none of it written yet.
    engine = Engine(str(starter_gguf), EngineConfig(n_slots=4, num_ctx=2048, kv_pool=8192,
                                                    cache_ram=256 << 20))
    settler = engine.settler
    assert settler is not None and settler.state is SettleState.SETTLED
    settler.shrink_after = 3600  # the test says when
    engine.start()
    try:
        assert (engine.llama.kv_committed() or 0) < 4 * MiB
        prompts = [" ".join([p] * 90) for p in PROMPTS]  # ~600-1,000 tokens each
        run_together(engine, [(p, 8, {}) for p in prompts])
        burst = engine.llama.kv_committed()
        latest = max(engine.slots, key=lambda s: s.last_used)
        kept = list(latest.cached)
        size = engine.llama.kv_size()
        assert burst is not None and size is not None, "the KV's pages are not counted"
        need = size * len(kept) // engine.llama.n_ctx
        # Four conversations' cells, well past one's and the slack a settle allows.
        assert burst > need + SLACK + 8 * MiB, (burst, need)
        assert settler.state is SettleState.ACTIVE and settler.settles == 0
        settler.shrink_after = 0.0
        wait_for(lambda: settler.state is SettleState.SETTLED, timeout=60)
        assert settler.settles == 1, (burst, need, engine.llama.kv_committed())
        settled = engine.llama.kv_committed()
        assert settled is not None and settled < burst // 2  # one of four kept
        assert [s.cached for s in engine.slots if s.cached] == [kept]
        status = engine.status()
        assert status["cache_entries"] == 3  # the three others, in the prompt cache
        # The kept one is served from its cells; the others from the prompt cache.
        settler.shrink_after = 3600
        [latest_prompt] = [p for p in prompts
                           if kept[:len(engine.tokenize(p))] == engine.tokenize(p)]
        _, stats = run(engine, latest_prompt, 4)
        assert stats.prompt_eval_count <= 2
        hits = engine.status()["cache_hits"]
        others = [p for p in prompts if p != latest_prompt]
        for prompt in others:
            _, stats = run(engine, prompt, 4)
            assert stats.prompt_eval_count < 16
        assert engine.status()["cache_hits"] == hits + 3
    finally:
        engine.stop()


def test_a_settle_waits_for_the_quiet_and_comes_once() -> None:
    from corral.runner.kv.settle import SettleState, Settler

    settler = Settler(llama=None, shrink_after=30.0)  # type: ignore[arg-type]
    assert not settler.due(100.0)  # nothing written since it was made
    settler.busy(100.0)
    assert settler.state is SettleState.ACTIVE
    assert not settler.due(129.9) and settler.due(130.0)
    settler.busy(131.0)  # a request came back: the quiet starts again
    assert not settler.due(160.9) and settler.due(161.0)


def test_a_request_ended_within_one_step_counts_and_a_queued_one_waits() -> None:
    """The engine may never be seen busy between two rests (a request placed, decoded
    and ended in one step): its steps say it ran. A settle that is due waits while a
    request is queued (a disk read, the inbox), which it would only delay."""
    from types import SimpleNamespace

    from corral.runner.engine.housekeeping import Housekeeping
    from corral.runner.kv.settle import SettleState, Settler
    from corral.runner.watch import StepWatch

    # A llama whose pages cannot be told (stock ggml): a settle is then a no-op.
    settler = Settler(SimpleNamespace(kv_committed=lambda: None, kv_size=lambda: None),
                      shrink_after=30.0)  # type: ignore[arg-type]
    waiting = [0]
    house = Housekeeping(SimpleNamespace(ctx=None), None, settler,  # type: ignore[arg-type]
                         StepWatch(), lambda: waiting[0])

    def rest(now: float, steps: int, queued: int = 0) -> None:
        waiting[0] = queued
        house.rest(True, now, [], False, lambda slot: None, steps)

    rest(0.0, steps=0)
    assert settler.state is SettleState.SETTLED
    rest(1.0, steps=1)  # one step ran since the last rest, though idle at both
    assert settler.state is SettleState.ACTIVE and settler.busy_at == 1.0
    rest(40.0, steps=1, queued=1)
    assert settler.state is SettleState.ACTIVE  # due, but a request waits
    rest(41.0, steps=1)
    assert settler.state is SettleState.SETTLED and settler.settles == 0


def test_a_token_a_slot_owes_waits_till_the_answer_is_out_or_work_comes() -> None:
    """The redo of an owed prompt token (a decode on every core) waits QUIET after the
    step that ended the request, while its answer is on its way out; a request that
    comes meanwhile has it done first, so what the slot holds at a placement never
    depends on when the request came. The engine's wait for work ends when it is due,
    and the presave of idle slots waits while a request is queued."""
    from types import SimpleNamespace

    from corral.runner.engine.housekeeping import QUIET, Housekeeping
    from corral.runner.slots.slot import Owed, Slot
    from corral.runner.watch import StepWatch

    redone: list[float] = []
    waiting = [0]
    now = [0.0]
    slot = Slot(seq_id=0, num_ctx=64, cached=[1, 2, 3])

    def redo(slots: list[Slot]) -> None:  # as Run.redo leaves them
        redone.append(now[0])
        order.append("redo")
        slot.owed = None

    order: list[str] = []
    house = Housekeeping(SimpleNamespace(ctx=None), None, None,  # type: ignore[arg-type]
                         StepWatch(), lambda: waiting[0], redo,
                         presave=lambda slots: order.append("presave"))

    def rest(at: float, steps: int, idle: bool = True) -> float:
        now[0] = at
        house.rest(idle, at, [slot], True, lambda s: None, steps)
        return house.wait(at)

    slot.owed = Owed(3, 4, 3)
    assert rest(10.0, steps=1) == pytest.approx(QUIET) and redone == []  # the answer goes out
    assert rest(10.0 + QUIET / 2, steps=1) == pytest.approx(QUIET / 2) and redone == []
    assert order == []  # nor is the slot copied to the prompt cache yet
    assert rest(10.0 + QUIET, steps=1) == 0.5 and redone == [10.0 + QUIET]
    assert order == ["redo", "presave"]  # what is copied holds the whole prompt
    rest(10.0 + 2 * QUIET, steps=1)
    assert order == ["redo", "presave"]  # once for each step's end
    slot.owed = Owed(3, 4, 3)
    rest(20.0, steps=2)
    waiting[0] = 1  # a request in the inbox: done before it is placed
    rest(20.001, steps=2)
    assert redone == [10.0 + QUIET, 20.001]
    slot.owed = Owed(3, 4, 3)
    waiting[0] = 0
    rest(30.0, steps=3)
    rest(30.001, steps=3, idle=False)  # placed already: done before the step plans it
    assert redone[-1] == 30.001
    waiting[0] = 1  # a disk read in flight: the presave waits for it,
    assert house.wait(40.0) == 0.5  # and so does the engine (its end wakes it)
    waiting[0] = 0
    assert house.wait(40.0) == 0.0  # now it is due
