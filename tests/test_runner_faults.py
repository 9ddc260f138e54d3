"""Faults that used to be quiet: an engine thread that fails, a runner that stops
answering. Each ends every request it holds with an error, never a hang, and the next
request loads the model afresh, while other models, `ps` and `tags` answer as usual."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from corral.errors import EngineFailed
from corral.registry.store import Store
from corral.runner.engine.plan import StepPlan
from corral.runner.client import RunnerProcess
from corral.runner.llama.context import EngineConfig
from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Embed, Failed, Job, SamplingParams, Token
from corral.options import Options
from corral.runner.loadconfig import LoadConfig
from corral.runner.process.main import Handler
from corral.runner.process.service import RunnerService
from corral.runner.wire import CompletionJob, LoadReport
from corral.server.daemon import Daemon
from tests.support import stand_in_runner, start_daemon, wait_for

MODEL, CHAT = "gemma3:270m-base", "smollm2:135m"
DEADLINE = 120.0


class FailAt:
    """A step hook that raises at the `n`th step, as a bug in a step would."""

    def __init__(self, n: int) -> None:
        self.n, self.steps = n, 0

    def __call__(self, plan: StepPlan) -> None:
        self.steps += 1
        if self.steps == self.n:
            raise RuntimeError("a bug in the step")


def events(job: Job) -> Iterator[Token | Done | Failed]:
    while True:
        event = job.events.get(timeout=DEADLINE)
        yield event
        if not isinstance(event, Token):
            return


@pytest.mark.model
def test_a_failed_engine_ends_every_job_and_refuses_new_ones(starter_gguf: Path) -> None:
    engine = Engine(str(starter_gguf), EngineConfig(n_slots=2, num_ctx=256),
                    step_hook=FailAt(6))
    engine.start()
    try:
        greedy = SamplingParams(temperature=0)
        jobs = [engine.submit(Job(prompt=engine.tokenize(p), params=greedy, num_predict=100))
                for p in ("Once upon a time", "The capital of France is")]
        for job in jobs:
            *tokens, last = events(job)
            assert isinstance(last, Failed) and isinstance(last.error, EngineFailed)
            assert "a bug in the step" in last.error.message
        assert engine.failed.wait(DEADLINE) and not engine.running()
        with pytest.raises(EngineFailed):
            engine.submit(Job(prompt=engine.tokenize("Hello"), params=greedy))
        with pytest.raises(EngineFailed):
            engine.run_embed(Embed([engine.tokenize("Hello")], True))
        # The runner's HTTP face says so: its health check and a new completion answer
        # the failure, in the shape the daemon's client turns back into EngineFailed.
        server = ThreadingHTTPServer(("127.0.0.1", 0), type(
            "H", (Handler,), {"service": RunnerService(engine, LoadReport())}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            for resp in (httpx.get(url + "/health", timeout=DEADLINE),
                         httpx.post(url + "/completion", json={"prompt": "Hi"},
                                    timeout=DEADLINE)):
                assert resp.status_code == 500 and resp.json()["kind"] == "EngineFailed"
        finally:
            server.shutdown()
    finally:
        engine.stop()


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """The first runner's 4th step raises, as a bug would (tests/support.py: STAND_IN)."""
    return stand_in_runner(tmp_path, 'raise RuntimeError("a bug in the step")')


@pytest.mark.model
def test_a_runner_whose_engine_failed_exits_on_its_own(starter_gguf: Path,
                                                        tmp_path: Path) -> None:
    script, _ = stand_in(tmp_path)
    runner = RunnerProcess(LoadConfig(model=str(starter_gguf), num_ctx=256),
                           python=str(script))
    runner.start(timeout=DEADLINE)
    assert runner.alive() and runner.proc is not None
    job = CompletionJob("Once upon a time", options=Options(temperature=0, num_predict=50))
    with pytest.raises(EngineFailed):
        list(runner.completion(job))
    assert not runner.alive()  # dead to the daemon at once
    assert runner.proc.wait(timeout=DEADLINE) == 1  # and gone by itself, unkilled
    runner.kill()


def runner_pids(d: Daemon) -> dict[str, int]:
    return {m.record.name.display(): m.runner.pid  # type: ignore[union-attr]
            for m in d.scheduler.running()}


def generate(d: Daemon, model: str = MODEL, stream: bool = False, n: int = 8) -> Any:
    body = {"model": model, "prompt": "Once upon a time", "raw": True, "stream": stream,
            "options": {"temperature": 0, "num_predict": n}}
    if not stream:
        return httpx.post(d.url + "/api/generate", json=body, timeout=DEADLINE)
    with httpx.stream("POST", d.url + "/api/generate", json=body, timeout=DEADLINE) as resp:
        assert resp.status_code == 200
        return [json.loads(raw) for raw in resp.iter_lines()]


@pytest.mark.model
def test_a_failed_engine_is_a_crash_to_the_daemon(starter_store: Store, tmp_path: Path) -> None:
    script, marker = stand_in(tmp_path)
    d = start_daemon(starter_store, tmp_path / "daemon",
                     runner_factory=lambda c: RunnerProcess(c, python=str(script)))
    try:
        lines = generate(d, stream=True, n=50)  # the stream in flight ends with the error
        assert "error" in lines[-1] and not lines[-1].get("done")
        assert "engine failed" in lines[-1]["error"] and not marker.exists()
        wait_for(lambda: MODEL not in runner_pids(d), DEADLINE)  # forgotten at once
        again = generate(d)  # the next request loads a fresh runner
        assert again.status_code == 200 and again.json()["done"]
    finally:
        d.shutdown()


@pytest.mark.model
def test_a_stopped_runner_ends_its_request_and_is_replaced(starter_store: Store,
                                                           tmp_path: Path) -> None:
    d = start_daemon(starter_store, tmp_path / "daemon", RUNNER_TIMEOUT="3s",
                     MAX_LOADED_MODELS="2")
    try:
        assert generate(d).status_code == 200 and generate(d, CHAT).status_code == 200
        stopped = runner_pids(d)[MODEL]
        os.kill(stopped, signal.SIGSTOP)
        try:
            result: list[httpx.Response] = []
            waiting = threading.Thread(target=lambda: result.append(generate(d)))
            waiting.start()
            # While its request waits: ps, tags and the other model answer as usual.
            listed = httpx.get(d.url + "/api/ps", timeout=DEADLINE).json()["models"]
            assert {m["name"] for m in listed} >= {MODEL, CHAT}
            assert httpx.get(d.url + "/api/tags", timeout=DEADLINE).status_code == 200
            assert generate(d, CHAT).status_code == 200
            waiting.join(DEADLINE)
            [resp] = result  # an error status, not a hang
            assert resp.status_code >= 500 and "error" in resp.json()
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed, as it should be
                os.kill(stopped, signal.SIGCONT)
        wait_for(lambda: not Path(f"/proc/{stopped}").exists(), DEADLINE)
        assert generate(d).status_code == 200  # loaded afresh
        assert runner_pids(d)[MODEL] != stopped
    finally:
        d.shutdown()
