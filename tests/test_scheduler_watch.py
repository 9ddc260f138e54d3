"""The scheduler never waits on a runner: health checks, shares of the cores and cache
drops are calls made outside its lock, and a runner that stops answering while requests
need it is killed and replaced. Fake runners whose calls block on an event the test holds,
and a fake clock."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from corral.config import load_settings
from corral.errors import RunnerError
from corral.registry.models import ModelRecord
from corral.runner.loadconfig import LoadConfig
from corral.runner.wire import Health
from corral.server.residency.scheduler import ModelState, Scheduler
from tests.support import wait_for
from tests.test_scheduler import Clock, FakeRunner, acquire, record

DEADLINE = 20.0


class StuckRunner(FakeRunner):
    """A runner whose health check and share of the cores wait on `gate` while `stuck`,
    as a stopped or wedged process leaves its caller waiting until the call's deadline."""

    gate = threading.Event()
    stuck = False
    silent = False  # its health check fails at once (the deadline passed)

    def __init__(self, config: LoadConfig) -> None:
        super().__init__(config)
        self.in_call = threading.Event()

    def _block(self) -> None:
        if self.stuck and "stuck" in self.config.model:
            self.in_call.set()
            assert StuckRunner.gate.wait(DEADLINE)

    def health(self, timeout: float = 5.0) -> Health:
        self._block()
        if self.silent and "stuck" in self.config.model:
            raise RunnerError("runner process is unreachable: timed out")
        return super().health()

    def set_threads(self, n: int) -> None:
        self._block()
        super().set_threads(n)


def make(clock: Clock, **env: str) -> Scheduler:
    FakeRunner.started = []
    StuckRunner.gate, StuckRunner.stuck, StuckRunner.silent = threading.Event(), False, False
    settings = load_settings({"CORRAL_NUM_PARALLEL": "2", "CORRAL_RUNNER_TIMEOUT": "30s",
                              **{f"CORRAL_{k}": v for k, v in env.items()}})
    return Scheduler(settings, StuckRunner, clock=clock, free_memory=lambda: 1 << 40,
                     free_vram=lambda: 0, cores=2)


def one_model(tmp_path: Path) -> tuple[Clock, Scheduler, ModelRecord]:
    clock = Clock()
    return clock, make(clock), record(tmp_path, "stuck")


def in_thread(fn: Any) -> list[Any]:
    out: list[Any] = []
    threading.Thread(target=lambda: out.append(fn()), daemon=True).start()
    return out


def test_a_health_check_that_hangs_holds_no_lock(tmp_path: Path) -> None:
    s = make(Clock())
    stuck, other = record(tmp_path, "stuck"), record(tmp_path, "other")
    s.release(acquire(s, stuck))
    StuckRunner.stuck = True
    runner = FakeRunner.started[0]
    assert isinstance(runner, StuckRunner)
    round_done = in_thread(s.watch_once)
    assert runner.in_call.wait(DEADLINE)  # the watch is inside the stuck runner's call
    # Meanwhile every other path through the scheduler goes on: a request for another
    # model loads and is served, `ps` lists both, and the stuck model is held and let go.
    got = in_thread(lambda: acquire(s, other))
    wait_for(lambda: got, DEADLINE)
    assert {m.record.digest for m in s.running()} == {stuck.digest, other.digest}
    s.release(got[0])
    s.release(acquire(s, stuck))
    assert not round_done
    StuckRunner.gate.set()
    wait_for(lambda: round_done, DEADLINE)
    s.stop()


def test_ps_refreshes_without_waiting_on_a_stuck_runner(tmp_path: Path) -> None:
    s = make(Clock())
    stuck, other = record(tmp_path, "stuck"), record(tmp_path, "other")
    s.release(acquire(s, stuck))
    s.release(acquire(s, other))
    StuckRunner.stuck = True
    runner = FakeRunner.started[0]
    assert isinstance(runner, StuckRunner)
    done = in_thread(s.refresh)
    wait_for(lambda: done, DEADLINE)  # back past its short deadline, the call still hangs
    assert runner.in_call.is_set() and not StuckRunner.gate.is_set()
    assert s.loaded[other.digest].health is not None  # the one that answered is fresh
    StuckRunner.gate.set()
    s.stop()


def test_a_share_of_the_cores_that_hangs_delays_no_request(tmp_path: Path) -> None:
    s = make(Clock())
    stuck, other = record(tmp_path, "stuck"), record(tmp_path, "other")
    StuckRunner.stuck = True
    with s.hold(stuck, *_opts()):  # told its share: the courier waits on it
        runner = FakeRunner.started[0]
        assert isinstance(runner, StuckRunner) and runner.in_call.wait(DEADLINE)
        with s.hold(other, *_opts()) as entry:  # served while that note hangs
            assert entry.state is ModelState.READY
    assert s.courier.pending > 0  # the stuck note and the ones behind it wait
    StuckRunner.gate.set()
    wait_for(lambda: s.courier.pending == 0, DEADLINE)
    assert FakeRunner.started[1].threads  # the other runner was told in the end
    s.stop()


def _opts() -> tuple[Any, None]:
    from corral.options import Options

    return Options(), None


def test_a_silent_runner_that_a_request_needs_is_killed_and_replaced(tmp_path: Path) -> None:
    clock, s, rec = one_model(tmp_path)
    entry = acquire(s, rec)  # a request is running on it
    StuckRunner.silent = True
    s.watch_once()
    assert entry.silent_since == clock.now and rec.digest in s.loaded
    clock.now += 29
    s.watch_once()  # silent, but not yet for CORRAL_RUNNER_TIMEOUT
    assert s.loaded.get(rec.digest) is entry
    clock.now += 2
    s.watch_once()
    assert rec.digest not in s.loaded  # killed: its request ends with an error
    wait_for(lambda: not FakeRunner.started[0].running, DEADLINE)
    s.release(entry)
    StuckRunner.silent = False
    again = acquire(s, rec)
    assert again is not entry and len(FakeRunner.started) == 2
    s.stop()


def test_an_idle_silent_runner_stays_until_a_request_wants_it(tmp_path: Path) -> None:
    clock, s, rec = one_model(tmp_path)
    entry = acquire(s, rec)
    s.release(entry)
    StuckRunner.silent = True
    s.watch_once()
    # Silent past CORRAL_RUNNER_TIMEOUT (30 s) and within its keep-alive (300 s): an
    # hour, as this test once waited, expired the model on the keep-alive timer thread,
    # which then raced the assertion (a clean-clone CI run lost that race).
    clock.now += 60
    assert clock.now < entry.expires_at
    s.watch_once()
    assert s.loaded.get(rec.digest) is entry  # nobody needs it: it is left alone
    again = acquire(s, rec)  # a request would wait on it: a fresh one is loaded instead
    assert again is not entry
    wait_for(lambda: not FakeRunner.started[0].running, DEADLINE)  # killed on a helper
    s.stop()


def test_the_fit_reads_the_last_answer_and_a_good_answer_ends_silence(tmp_path: Path) -> None:
    clock, s, rec = one_model(tmp_path)
    entry = acquire(s, rec)
    assert entry.health is None
    s.watch_once()
    assert isinstance(entry.health, Health)
    StuckRunner.silent = True
    s.watch_once()
    assert entry.silent_since is not None and entry.health is not None  # kept for `ps`
    StuckRunner.silent = False
    clock.now += 100
    s.watch_once()
    assert entry.silent_since is None and s.loaded.get(rec.digest) is entry
    s.release(entry)
    s.stop()
