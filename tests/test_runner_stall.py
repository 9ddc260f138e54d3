"""Progress, not presence, is a runner's health: an engine thread held inside one step
past CORRAL_STEP_TIMEOUT (native code that does not return: a stopped RPC worker, a hung
device) ends every request the runner holds with an error, its /health says so, the
process exits on its own, and the daemon loads the model afresh for the next request.

The stall here is a step seam given to the runner (its step hook) that blocks, as
llama_decode blocks on a worker that stopped answering; tests/test_rpc.py stops a real
worker."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.errors import EngineFailed, RunnerError
from corral.options import Options
from corral.registry.store import Store
from corral.runner.client import RunnerProcess
from corral.runner.loadconfig import LoadConfig
from corral.runner.wire import CompletionJob, EmbedJob
from tests.support import stand_in_runner, start_daemon, stuck_native_runner, wait_for

MODEL = "gemma3:270m-base"
DEADLINE = 120.0
# Far above any real step of the 270M starter on a loaded two-core machine (tens of
# milliseconds), so that only the held step trips it.
BOUND = 10.0


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """The first runner's 4th step never returns (tests/support.py: STAND_IN)."""
    return stand_in_runner(tmp_path, "threading.Event().wait()")


@pytest.mark.model
def test_a_stalled_step_ends_the_runners_requests_and_the_runner(starter_gguf: Path,
                                                                  tmp_path: Path) -> None:
    script, marker = stand_in(tmp_path)
    runner = RunnerProcess(LoadConfig(model=str(starter_gguf), num_ctx=256, n_slots=2,
                                      step_timeout=BOUND), python=str(script))
    runner.start(timeout=DEADLINE)
    assert runner.proc is not None
    embedded: list[Any] = []
    job = CompletionJob("Once upon a time", options=Options(temperature=0, num_predict=50))
    lines = runner.completion(job)
    next(lines)  # streaming: the stall is ahead
    wait_for(lambda: not marker.exists(), DEADLINE)  # the 4th step is held now
    # An embedding queued behind the held step is answered by the stall too, not never.
    waiter = threading.Thread(target=lambda: embedded.append(_embed(runner)))
    waiter.start()
    with pytest.raises(EngineFailed, match="stalled.*CORRAL_STEP_TIMEOUT"):
        list(lines)
    waiter.join(DEADLINE)
    assert isinstance(embedded[0], RunnerError) and "stalled" in str(embedded[0])
    assert not runner.alive()  # dead to the daemon at once
    assert runner.proc.wait(timeout=DEADLINE) == 1  # and gone by itself, unkilled
    runner.kill()


@pytest.mark.model
def test_a_daemon_told_of_the_stall_first_still_gets_each_streams_error(
        starter_gguf: Path, tmp_path: Path) -> None:
    """/health may tell the daemon before a stream's error line has gone out (a fast
    machine did, in CI): the daemon then ends the runner, which must not cut the stream
    short. The runner fails its streams before it answers /health with the failure, and
    the daemon gives a failed runner the time to exit by itself."""
    script, marker = stand_in(tmp_path)
    runner = RunnerProcess(LoadConfig(model=str(starter_gguf), num_ctx=256, n_slots=1,
                                      step_timeout=BOUND), python=str(script))
    runner.start(timeout=DEADLINE)
    assert runner.proc is not None
    lines = runner.completion(CompletionJob("Once upon a time",
                                            options=Options(temperature=0, num_predict=50)))
    next(lines)
    ended: list[Exception] = []
    reader = threading.Thread(target=lambda: ended.append(_drain(lines)))
    reader.start()  # as a request's thread reads its stream in the daemon
    wait_for(lambda: not marker.exists(), DEADLINE)
    wait_for(lambda: _failed(runner), DEADLINE)  # told: the daemon forgets it now
    runner.end()
    assert runner.proc.returncode == 1  # it exited by itself, unkilled
    reader.join(DEADLINE)
    assert isinstance(ended[0], EngineFailed) and "stalled" in str(ended[0])


@pytest.mark.model
def test_a_resize_stuck_in_its_copy_ends_the_requests_within_the_bound(
        starter_gguf: Path, tmp_path: Path) -> None:
    """A second request grows the context from one stream to two; moving the first
    request's sequence onto it (llama_state_seq_set_data) never returns, as on a stopped
    RPC worker. The watchdog names the resize, and both requests end with the error."""
    script, armed = stuck_native_runner(tmp_path, "llama_cpp", "llama_state_seq_set_data")
    runner = RunnerProcess(LoadConfig(model=str(starter_gguf), num_ctx=256, n_slots=2,
                                      start_slots=1, step_timeout=BOUND), python=str(script))
    runner.start(timeout=DEADLINE)
    assert runner.proc is not None
    first = runner.completion(CompletionJob("Once upon a time", options=Options(
        temperature=0, num_predict=2000)))
    next(first)  # decoding on the only stream
    armed.touch()
    ended: list[Exception] = []
    second = threading.Thread(target=lambda: ended.append(_drain(runner.completion(
        CompletionJob("The sea", options=Options(temperature=0, num_predict=8))))))
    second.start()  # needs a second stream: the context grows
    assert "a resize's copy of the sequences" in str(_ended(first))
    second.join(DEADLINE)
    assert isinstance(ended[0], EngineFailed) and "stalled" in str(ended[0])
    assert not armed.exists()  # the stuck call was the copy's
    assert runner.proc.wait(timeout=DEADLINE) == 1
    runner.kill()


@pytest.mark.model
def test_a_stuck_media_encode_ends_the_requests_within_the_bound(
        chat_gguf: Path, tmp_path: Path) -> None:
    """The projector's encode (mtmd_encode_chunk) never returns: the watchdog watches
    the media thread as it does the engine's steps, so the image's request ends with the
    stall instead of waiting forever, and the runner goes."""
    from corral.runner.wire import MARKER
    from tests.vision_model import png_bytes, write_projector

    projector = write_projector(tmp_path / "mlp.gguf", "mlp", 576)
    script, armed = stuck_native_runner(tmp_path, "llama_cpp.mtmd_cpp", "mtmd_encode_chunk")
    runner = RunnerProcess(LoadConfig(model=str(chat_gguf), projector=str(projector),
                                      num_ctx=1024, n_slots=2, step_timeout=BOUND),
                           python=str(script))
    runner.start(timeout=DEADLINE)
    assert runner.proc is not None
    _drain_ok(runner.completion(CompletionJob("Hello", options=Options(num_predict=2))))
    armed.touch()  # past the first step's grace: the bound itself applies now
    image = base64.b64encode(png_bytes(40, 30, seed=1)).decode()
    looked = runner.completion(CompletionJob.from_json({
        "prompt": "What is this? " + MARKER, "images": [image],
        "options": {"temperature": 0, "num_predict": 8}}))
    failure = _ended(looked)
    assert "one media encode has run" in str(failure), failure
    assert not armed.exists()
    assert runner.proc.wait(timeout=DEADLINE) == 1
    runner.kill()


def _ended(lines: Any) -> Exception:
    """How the stream ended, read on a thread of its own: within DEADLINE, or a failure."""
    ended: list[Exception] = []
    reader = threading.Thread(target=lambda: ended.append(_drain(lines)), daemon=True)
    reader.start()
    reader.join(DEADLINE)
    assert ended, f"the stream had not ended after {DEADLINE:g} s"
    return ended[0]


def _drain_ok(lines: Any) -> None:
    for _ in lines:
        pass


def _drain(lines: Any) -> Exception:
    try:
        list(lines)
    except Exception as exc:
        return exc
    return AssertionError("the stream ended without an error")


def _failed(runner: RunnerProcess) -> bool:
    try:
        runner.health(5.0)
    except EngineFailed:
        return True
    return False


def _embed(runner: RunnerProcess) -> Any:
    try:
        return runner.embed(EmbedJob(input=["a"]))
    except RunnerError as exc:
        return exc


def _generate(url: str, stream: bool, n: int = 8) -> Any:
    body = {"model": MODEL, "prompt": "Once upon a time", "raw": True, "stream": stream,
            "options": {"temperature": 0, "num_predict": n}}
    if not stream:
        return httpx.post(url + "/api/generate", json=body, timeout=DEADLINE)
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=DEADLINE) as resp:
        assert resp.status_code == 200
        return [json.loads(raw) for raw in resp.iter_lines()]


@pytest.mark.model
def test_a_stalled_runner_is_replaced_while_ps_answers(starter_store: Store,
                                                        tmp_path: Path) -> None:
    script, marker = stand_in(tmp_path)
    d = start_daemon(starter_store, tmp_path / "daemon", STEP_TIMEOUT=f"{BOUND:g}s",
                     runner_factory=lambda c: RunnerProcess(c, python=str(script)))
    try:
        streamed: list[Any] = []
        held = threading.Thread(target=lambda: streamed.append(_generate(d.url, True, 50)))
        held.start()
        wait_for(lambda: not marker.exists(), DEADLINE)  # the step is held
        listed = httpx.get(d.url + "/api/ps", timeout=5.0)  # answers meanwhile
        assert listed.status_code == 200 and listed.json()["models"][0]["name"] == MODEL
        held.join(DEADLINE)
        last = streamed[0][-1]  # the stream ends with the error, not a hang
        assert "stalled" in last["error"] and not last.get("done")
        again = _generate(d.url, False)  # the next request loads a fresh runner
        assert again.status_code == 200 and again.json()["done"]
    finally:
        d.shutdown()
