"""The runner process with the real model: streaming, cancel, embed, and crashes."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from corral.errors import RunnerError
from corral.registry.gguf import inspect_gguf
from corral.runner import fitestimate
from corral.runner.client import RunnerProcess
from corral.runner.loadconfig import LoadConfig
from corral.runner.wire import CompletionJob, DoneLine, EmbedJob, TokenLine

job = CompletionJob.from_json  # a job as the daemon sends it

pytestmark = pytest.mark.model  # llama.cpp runs in every test here

GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def runner(starter_gguf: Path) -> Iterator[RunnerProcess]:
    proc = RunnerProcess(LoadConfig(str(starter_gguf), n_slots=2, num_ctx=512))
    proc.start(timeout=120)
    yield proc
    proc.stop()


def test_load_report(runner: RunnerProcess) -> None:
    report = runner.report
    assert report.slots == 2 and report.num_ctx == 512 and report.n_ctx >= 1024
    assert report.weights > 200_000_000 and report.kv > 0
    assert report.gpu_layers == 0 and report.layers == 18 and report.size_vram == 0
    # The daemon renders templates; it needs the model's own BOS and EOS text for them.
    assert report.bos == "<bos>" and report.eos == "<eos>"


def test_num_gpu_without_a_gpu_reports_every_layer_on_the_cpu(starter_gguf: Path) -> None:
    # llama.cpp keeps the layers on the CPU when there is no device to offload to; the
    # report (and so `ps`) must not claim a split it did not make.
    proc = RunnerProcess(LoadConfig(str(starter_gguf), n_slots=1, num_ctx=256, num_gpu=9))
    proc.start(timeout=120)
    try:
        assert proc.report.gpu_layers == 0 and proc.report.size_vram == 0
    finally:
        proc.stop()


def test_generate_and_chat_stream(runner: RunnerProcess) -> None:
    lines = list(runner.completion(job({"prompt": "The capital of France is", "options": GREEDY})))
    done = lines[-1]
    assert isinstance(done, DoneLine) and done.eval_count == 16
    assert done.prompt_tokens == len(runner.tokenize("The capital of France is",
                                                     add_special=True))
    assert all(isinstance(line, TokenLine) for line in lines[:-1])
    text = "".join(line.content for line in lines if isinstance(line, TokenLine))
    assert text.strip()
    assert done.context == ()  # the tokens come back only when asked (below)
    # Text the daemon rendered with a BOS of its own: the tokenizer adds none.
    chat = list(runner.completion(job({"prompt": "<bos>User: Hi\nAssistant:", "add_bos": False,
                                       "return_context": True,
                                       "options": {**GREEDY, "stop": ["User:"]}})))
    end = chat[-1]
    assert isinstance(end, DoneLine) and end.prompt_eval_count > 0
    assert list(end.context[:1]) == runner.tokenize("<bos>", add_special=False)


def test_tokenize_round_trip(runner: RunnerProcess) -> None:
    tokens = runner.tokenize("hello world")
    assert tokens and runner.detokenize(tokens) == "hello world"


def test_embed_normalised(runner: RunnerProcess) -> None:
    out = runner.embed(EmbedJob(("hello", "world")))
    assert len(out.embeddings) == 2 and out.prompt_eval_count > 0
    norm = sum(x * x for x in out.embeddings[0])
    assert abs(norm - 1.0) < 1e-3
    raw = runner.embed(EmbedJob(("hello",), normalize=False)).embeddings[0]
    assert abs(sum(x * x for x in raw) - 1.0) > 1e-3


def test_cancel_by_id(runner: RunnerProcess) -> None:
    stream = runner.completion(job({"prompt": "Once upon a time", "id": "job-1",
                                "options": {"temperature": 0, "num_predict": 500}}))
    first = next(stream)  # no back-channel ahead of the reply: the daemon rendered it
    assert isinstance(first, TokenLine)
    runner.cancel("job-1")
    last = list(stream)[-1]
    assert isinstance(last, DoneLine) and last.done_reason == "cancel"
    assert runner.health().busy_slots == 0


def test_requests_share_a_kept_alive_connection_and_a_stream_is_chunked(
        runner: RunnerProcess) -> None:
    # A connection per request cost each first token a connect and a thread started in
    # the runner; a stream's end is its last chunk, not the connection's.
    conn = http.client.HTTPConnection("127.0.0.1", runner.port, timeout=60)
    try:
        conn.connect()
        sock = conn.sock
        for _ in range(2):
            conn.request("POST", "/completion", body=json.dumps(
                {"prompt": "The capital of France is", "options": GREEDY}),
                headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.chunked and not resp.will_close
            lines = [json.loads(line) for line in resp.read().splitlines() if line]
            assert lines[-1]["done"] is True and len(lines) >= 2
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
        assert conn.sock is sock  # never closed and opened again
    finally:
        conn.close()


def test_bad_request_is_an_error_not_a_crash(runner: RunnerProcess) -> None:
    # What crosses the wire is checked where it lands: a 400, and the runner lives on.
    for body in ({"prompt": "x", "options": {"temperature": "hot"}}, {"prompt": 3},
                 {"prompt": "x", "context": ["a"]}, {"prompt": "x", "add_bos": "yes"},
                 {"prompt": "x", "frobnicate": 1}):
        r = httpx.post(f"http://127.0.0.1:{runner.port}/completion", json=body, timeout=30)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    for path, body in (("/embed", {"input": 5}), ("/embed", {"input": "x", "normalize": 1}),
                       ("/embed", {"input": "x", "dimensions": -1}),
                       ("/tokenize", {"content": 5}), ("/detokenize", {"tokens": ["a"]}),
                       ("/threads", {"n": "2"}), ("/threads", {"n": True}),
                       ("/cancel", {"id": 7})):
        r = httpx.post(f"http://127.0.0.1:{runner.port}{path}", json=body, timeout=30)
        assert r.status_code == 400 and "error" in r.json(), (path, body, r.text)
    assert runner.alive() and runner.health().threads > 0  # /threads {"n": True} set nothing


def test_sigkill_mid_stream_errors_without_hanging(starter_gguf: Path) -> None:
    proc = RunnerProcess(LoadConfig(str(starter_gguf), n_slots=1, num_ctx=256))
    proc.start(timeout=120)
    stream = proc.completion(job({"prompt": "Once upon a time",
                              "options": {"temperature": 0, "num_predict": 5000}}))
    next(stream)
    killer = threading.Timer(0.2, os.kill, args=(proc.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RunnerError, match="terminated|lost"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 30
    proc.kill()


def test_malformed_model_fails_to_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 32)
    proc = RunnerProcess(LoadConfig(str(bad)))
    with pytest.raises(RunnerError, match="invalid model file"):
        proc.start(timeout=60)


def test_offload_estimate(starter_gguf: Path) -> None:
    info = inspect_gguf(starter_gguf)
    cpu = fitestimate.estimate(info, 4096, 4, free_vram=0, n_vocab=262144)
    assert cpu.gpu_layers == 0 and cpu.gpu_bytes == 0 and cpu.cpu_bytes == cpu.total
    assert cpu.kv == fitestimate.kv_bytes_per_token(info) * 4096 * 4
    assert fitestimate.kv_bytes_per_token(info) == 18 * 1 * (256 + 256) * 2
    big = fitestimate.estimate(info, 4096, 4, free_vram=64 << 30, n_vocab=262144)
    assert big.gpu_layers == 18 and big.cpu_bytes == 0
    per_layer = info.layer_bytes()[0] + cpu.kv // 18
    part = fitestimate.estimate(info, 4096, 4, free_vram=big.compute + (big.weights - sum(
        info.layer_bytes().values())) + 5 * per_layer + 10, n_vocab=262144)
    assert 4 <= part.gpu_layers <= 5 and 0 < part.gpu_bytes < part.total
    forced = fitestimate.estimate(info, 4096, 4, free_vram=0, num_gpu=7)
    assert forced.gpu_layers == 7
