"""The scheduler as a pure state machine, with fake runners and a fake clock."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from corral.config import FOREVER, load_settings
from corral.errors import RunnerError, ServerBusy
from corral.options import Options
from corral.registry.models import ModelRecord
from corral.registry.names import parse_name
from corral.runner.loadconfig import LoadConfig
from corral.runner.wire import CacheStats, Health, LoadReport
from corral.server.residency.scheduler import ModelState, Scheduler
from tests.gguf_files import write_tiny_gguf
from tests.support import wait_for


class FakeRunner:
    started: list["FakeRunner"] = []

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.report = LoadReport()
        self.running = False
        self.stopped = False
        self.threads: list[int] = []  # every share of the cores it was told

    def start(self, timeout: float) -> LoadReport:
        if "broken" in self.config.model:
            raise RunnerError("llama runner process has terminated: boom")
        self.running = True
        FakeRunner.started.append(self)
        return self.report

    def stop(self, timeout: float = 10.0) -> None:
        self.running, self.stopped = False, True

    def end(self) -> None:
        self.running = False

    def alive(self) -> bool:
        return self.running

    def set_threads(self, n: int) -> None:
        self.threads.append(n)

    cache_bytes = 0  # what its prompt cache holds in RAM
    cleared = False

    def health(self, timeout: float = 5.0) -> Health:
        return Health(cache=CacheStats(bytes=self.cache_bytes))

    def clear_cache(self) -> None:
        self.cleared, self.cache_bytes = True, 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **env: str) -> Scheduler:
    FakeRunner.started = []
    settings = load_settings({"CORRAL_NUM_PARALLEL": "2", **{f"CORRAL_{k}": v
                                                             for k, v in env.items()}})
    return Scheduler(settings, FakeRunner, clock=clock, free_memory=lambda: 1 << 40,
                     free_vram=lambda: 0)


def record(tmp_path: Path, name: str) -> ModelRecord:
    path = write_tiny_gguf(tmp_path / f"{name}.gguf")
    return ModelRecord(parse_name(name), name * 8, 1, 0.0, path, "sha256:" + "0" * 64)


def acquire(s: Scheduler, rec: ModelRecord, keep_alive: float | None = None,
            **options: Any):  # type: ignore[no-untyped-def]
    return s.acquire(s.admit(rec), rec, Options.parse(options), keep_alive)


def tick(s: Scheduler, clock: Clock, seconds: float) -> None:
    """Move the clock and run the keep-alive pass at the new time, synchronously: what it
    does (or does not do) is done when this returns, whatever the timer thread is up to."""
    clock.now += seconds
    s.expire_once(clock.now)


def test_loads_once_and_counts_references(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "a")
    first = acquire(s, rec)
    second = acquire(s, rec)
    assert first is second and first.refcount == 2 and len(FakeRunner.started) == 1
    assert first.slots == 2 and first.state is ModelState.READY
    s.release(first)
    s.release(second)
    assert first.expires_at == clock.now + 300.0
    s.stop()


@pytest.mark.parametrize("setting,on", [({}, True), ({"SPECULATIVE": "off"}, False)])
def test_the_speculative_setting_reaches_the_load_configuration(
        tmp_path: Path, clock: Clock, setting: dict[str, str], on: bool) -> None:
    s = make(clock, **setting)
    s.release(acquire(s, record(tmp_path, "a")))
    assert FakeRunner.started[0].config.speculative is on
    s.stop()


@pytest.mark.parametrize("setting,shared", [
    ({}, True), ({"DETERMINISTIC": "1"}, False), ({"KV_POOL": "off"}, False)])
def test_the_slots_share_one_kv_buffer_unless_deterministic_or_asked(
        tmp_path: Path, clock: Clock, setting: dict[str, str], shared: bool) -> None:
    s = make(clock, NUM_PARALLEL="0", **setting)
    s.release(acquire(s, record(tmp_path, "a")))
    config = FakeRunner.started[0].config
    # Every slot's whole context in the buffer; elastic streams the runner's fallback.
    assert config.kv_pool == (config.n_slots * config.num_ctx if shared else 0)
    assert config.kv_shared is shared
    assert config.n_slots == 16 and config.num_ctx > 0 and config.start_slots == 1
    s.stop()


def test_keep_alive_never_fires_while_busy(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "a")
    entry = acquire(s, rec, keep_alive=1.0)
    tick(s, clock, 60)
    assert entry.state is ModelState.READY and entry.expires_at is None
    s.release(entry)
    assert entry.expires_at == clock.now + 1.0
    tick(s, clock, 0.5)
    assert entry.state is ModelState.READY
    tick(s, clock, 0.6)
    assert entry.state is ModelState.UNLOADING  # this pass began it, not some later one
    wait_for(lambda: not s.loaded)
    assert FakeRunner.started[0].stopped
    s.stop()


def test_keep_alive_zero_and_forever(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    a, b = record(tmp_path, "a"), record(tmp_path, "b")
    ea = acquire(s, a, keep_alive=0)
    eb = acquire(s, b, keep_alive=FOREVER)
    s.release(ea)
    s.release(eb)
    wait_for(lambda: a.digest not in s.loaded)
    tick(s, clock, 10**9)
    assert b.digest in s.loaded and eb.expires_at is None
    s.unload(b)
    wait_for(lambda: not s.loaded)
    s.stop()


def test_omitted_keep_alive_keeps_the_current_value(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "a")
    s.release(acquire(s, rec, keep_alive=30.0))
    entry = acquire(s, rec, keep_alive=None)
    s.release(entry)
    assert entry.keep_alive == 30.0 and entry.expires_at == clock.now + 30.0
    s.stop()


def test_queue_limit(tmp_path: Path, clock: Clock) -> None:
    s = make(clock, MAX_QUEUE="3")
    rec = record(tmp_path, "a")
    held = [acquire(s, rec) for _ in range(5)]  # 2 slots busy, 3 queued in the runner
    with pytest.raises(ServerBusy, match="maximum pending requests exceeded"):
        s.admit(rec)
    s.release(held.pop())
    s.admit(rec)  # room again
    s.stop()


def test_eviction_prefers_idle_with_shortest_keep_alive(tmp_path: Path, clock: Clock) -> None:
    s = make(clock, MAX_LOADED_MODELS="2")
    a, b, c = record(tmp_path, "a"), record(tmp_path, "b"), record(tmp_path, "c")
    s.release(acquire(s, a, keep_alive=600))
    s.release(acquire(s, b, keep_alive=60))
    acquire(s, c)
    assert set(s.loaded) == {a.digest, c.digest}
    s.stop()


@pytest.mark.parametrize("cached", [True, False])
def test_prompt_caches_are_dropped_before_any_model_is_evicted(tmp_path: Path, clock: Clock,
                                                                cached: bool) -> None:
    a, b = record(tmp_path, "a"), record(tmp_path, "b")
    need = b.model_path.stat().st_size
    settings = load_settings({"CORRAL_NUM_PARALLEL": "1"})
    s = Scheduler(settings, FakeRunner, clock=clock, free_memory=lambda: need - 1,
                  free_vram=lambda: 0)
    first = acquire(s, a)
    s.release(first)
    runner = first.runner
    assert isinstance(runner, FakeRunner)
    runner.cache_bytes = need if cached else 0  # free memory only counting the cache
    s.watch_once()  # the fit reads what the runner last said, and never asks it
    acquire(s, b)
    if cached:  # the cache went (a note sent outside the lock), and the model stayed
        wait_for(lambda: runner.cleared)
        assert set(s.loaded) == {a.digest, b.digest}
    else:
        assert set(s.loaded) == {b.digest}
    s.stop()


def test_busy_models_are_not_evicted(tmp_path: Path, clock: Clock) -> None:
    s = make(clock, MAX_LOADED_MODELS="1")
    a, b = record(tmp_path, "a"), record(tmp_path, "b")
    ea = acquire(s, a)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(acquire(s, b)))
    t.start()
    wait_for(lambda: s.blocked == 1)  # b's request waits for room instead of evicting a
    assert not got and s.loaded[a.digest].state is ModelState.READY
    s.release(ea)
    t.join(timeout=5)
    assert got and set(s.loaded) == {b.digest}
    s.stop()


def test_changed_load_option_reloads_after_active_requests(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "a")
    first = acquire(s, rec, num_ctx=1024)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(acquire(s, rec, num_ctx=2048)))
    t.start()
    wait_for(lambda: s.blocked == 1)  # the reload waits for the active request
    assert not got and first.refcount == 1 and first.state is ModelState.READY
    s.release(first)
    t.join(timeout=5)
    assert got[0] is not first and got[0].options.num_ctx == 2048
    assert len(FakeRunner.started) == 2 and FakeRunner.started[0].stopped
    same = acquire(s, rec, num_ctx=2048, temperature=0.1, num_gpu=-1)
    assert same is got[0]
    s.stop()


def test_draft_num_predict_reloads_only_a_model_with_a_draft(tmp_path: Path,
                                                              clock: Clock) -> None:
    """It bounds a draft model's proposals: on a model without one, no value of it is a
    reason to load the model again."""
    import dataclasses

    s = make(clock)
    plain = record(tmp_path, "a")
    first = acquire(s, plain, draft_num_predict=4)
    s.release(first)
    assert acquire(s, plain, draft_num_predict=8) is first
    s.release(first)
    drafted = dataclasses.replace(record(tmp_path, "b"), draft=plain.model_path)
    one = acquire(s, drafted, draft_num_predict=4)
    s.release(one)
    other = acquire(s, drafted, draft_num_predict=8)
    assert other is not one and other.options.draft_num_predict == 8
    s.stop()


class StuckRunner(FakeRunner):
    """A runner whose stop never returns (a process stuck in a driver, past SIGKILL)."""

    def stop(self, timeout: float = 10.0) -> None:
        threading.Event().wait()


def test_a_stop_that_never_returns_blocks_no_later_load(tmp_path: Path, clock: Clock) -> None:
    settings = load_settings({"CORRAL_NUM_PARALLEL": "1", "CORRAL_MAX_LOADED_MODELS": "1"})
    s = Scheduler(settings, StuckRunner, clock=clock, free_memory=lambda: 1 << 40,
                  free_vram=lambda: 0, unload_deadline=0.2)
    first = acquire(s, record(tmp_path, "a"))
    s.release(first)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(acquire(s, record(tmp_path, "b"))))
    t.start()  # "a" is evicted for it; its stop hangs for good
    t.join(timeout=30)
    assert got and got[0].state is ModelState.READY and got[0].record.name.model == "b"
    s.stop()


def test_crashed_runner_is_replaced_on_next_request(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "a")
    entry = acquire(s, rec)
    FakeRunner.started[0].running = False  # died
    s.runner_failed(entry)
    s.release(entry)
    again = acquire(s, rec)
    assert again is not entry and len(FakeRunner.started) == 2
    s.stop()


def test_failed_load_is_an_error_and_leaves_nothing(tmp_path: Path, clock: Clock) -> None:
    s = make(clock)
    rec = record(tmp_path, "broken")
    with pytest.raises(RunnerError, match="boom"):
        acquire(s, rec)
    assert not s.loaded and s.pending == 0
    s.stop()


def test_thread_shares_split_the_cores_between_busy_models() -> None:
    from corral.server.residency.threads import shares

    assert shares(2, ["a"], ["b"]) == {"a": 2, "b": 1}  # b would wake beside a: one core
    assert shares(2, ["a", "b"], []) == {"a": 1, "b": 1}  # each keeps one, neither fights
    assert shares(3, ["a", "b"], ["c"]) == {"a": 2, "b": 1, "c": 1}  # the spare goes first
    assert shares(2, ["a", "b", "c"], []) == {"a": 1, "b": 1, "c": 1}  # never below one
    assert shares(16, [], ["a"]) == {"a": 16}


def told_all(s: Scheduler) -> None:
    """Share the cores, and wait until the courier has told every runner."""
    s.share_cores()
    wait_for(lambda: s.courier.pending == 0)


def test_runners_are_told_their_share_when_busy_ones_come_and_go(tmp_path: Path,
                                                                  clock: Clock) -> None:
    settings = load_settings({"CORRAL_NUM_PARALLEL": "2"})
    s = Scheduler(settings, FakeRunner, clock=clock, free_memory=lambda: 1 << 40,
                  free_vram=lambda: 0, cores=2)
    a, b = record(tmp_path, "alpha"), record(tmp_path, "beta")
    ea = acquire(s, a)
    told_all(s)
    eb = acquire(s, b)
    told_all(s)
    ra, rb = (FakeRunner.started[0], FakeRunner.started[1])
    assert ra.threads[-1] == 1 and rb.threads[-1] == 1  # both busy: a core each
    s.release(ea)
    told_all(s)
    assert rb.threads[-1] == 2 and ra.threads[-1] == 1  # beta alone has both
    told = len(rb.threads)
    told_all(s)
    assert len(rb.threads) == told  # nothing changed: nobody is told again
    s.release(eb)
