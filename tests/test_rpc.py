"""A model split over two `corral rpc-server` workers on loopback and the local CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Iterator

import httpx
import pytest

from corral.registry.store import Store
from tests.support import DaemonFactory, free_port, wait_port

pytestmark = pytest.mark.model

MODEL = "gemma3:270m-base"
CORRAL = [sys.executable, "-c", "from corral.cli.launch import main; main()"]
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 8}
SPLIT = {**GREEDY, "num_gpu": 10}  # 10 of 18 layers on the workers, the rest here


@pytest.fixture
def workers() -> Iterator[list[tuple[str, subprocess.Popen[str]]]]:
    started = []
    env = dict(os.environ, CORRAL_DETERMINISTIC="1")
    for _ in range(2):
        port = free_port()
        proc = subprocess.Popen([*CORRAL, "rpc-server", "--port", str(port), "--threads", "1"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        started.append((f"127.0.0.1:{port}", proc))
    for endpoint, _ in started:
        wait_port(int(endpoint.rsplit(":", 1)[1]))
    yield started
    for _, proc in started:
        proc.kill()
        proc.wait()


def generate(url: str, options: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/api/generate", timeout=300, json={
        "model": MODEL, "prompt": "The capital of France is", "stream": False,
        "options": options})


def test_split_over_two_workers_then_one_dies(starter_store: Store,
                                              daemon_factory: DaemonFactory,
                                              workers: list[tuple[str, subprocess.Popen[str]]]
                                              ) -> None:
    (first, _), (second, second_proc) = workers
    d = daemon_factory(starter_store, NUM_PARALLEL="1", DETERMINISTIC="1",
                       RPC_SERVERS=f"{first},{second}")
    local = generate(d.url, {**GREEDY, "rpc_servers": ""})
    assert local.status_code == 200, local.text
    split = generate(d.url, SPLIT)
    assert split.status_code == 200, split.text
    assert split.json()["response"] == local.json()["response"]
    assert split.json()["eval_count"] == GREEDY["num_predict"]
    [running] = httpx.get(d.url + "/api/ps").json()["models"]
    assert 0 < running["size_rpc"] < running["size"] and running["size_vram"] == 0
    host, port = d.address
    shown = subprocess.run([*CORRAL, "ps"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, CORRAL_HOST=f"{host}:{port}"))
    assert shown.returncode == 0 and "% CPU/RPC" in shown.stdout, shown.stdout

    # A worker that dies mid-stream ends the stream with an error line.
    lines = []
    with httpx.stream("POST", d.url + "/api/generate", timeout=300, json={
            "model": MODEL, "prompt": "Once upon a time", "options": {**SPLIT,
                                                                     "num_predict": 400}}) as r:
        for line in r.iter_lines():
            lines.append(json.loads(line))
            if len(lines) == 2:
                second_proc.send_signal(signal.SIGKILL)
    assert "error" in lines[-1] and not lines[-1].get("done")

    # The next load names the missing worker; without it, the model loads cleanly.
    again = generate(d.url, SPLIT)
    assert again.status_code >= 500 and second in again.json()["error"]
    assert "unreachable" in again.json()["error"]
    alone = generate(d.url, {**SPLIT, "rpc_servers": first})
    assert alone.status_code == 200, alone.text
    assert alone.json()["response"] == local.json()["response"]


def test_rpc_server_warns_off_loopback() -> None:
    port = free_port()
    proc = subprocess.Popen([*CORRAL, "rpc-server", "--host", "0.0.0.0", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_port(port)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        assert "WARNING" in err and "no authentication" in err
    finally:
        proc.kill()


def test_bad_rpc_servers_option_is_a_400(starter_store: Store,
                                         daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NUM_PARALLEL="1")
    r = generate(d.url, {**GREEDY, "rpc_servers": "nonsense"})
    assert r.status_code == 400 and "is not host:port" in r.json()["error"]


def _impostor(reply: bytes) -> tuple[str, Any]:
    """A loopback port that answers every connection with `reply` and hangs up."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}", server


@pytest.mark.parametrize("reply", [os.urandom(64), b"", (28).to_bytes(8, "little") + bytes(
    [1, 0, 0, 0]) + bytes(24)], ids=["garbage", "silence", "old-version"])
def test_a_bad_worker_is_a_load_error_naming_it(starter_store: Store,
                                               daemon_factory: DaemonFactory,
                                               reply: bytes) -> None:
    endpoint, server = _impostor(reply)
    try:
        d = daemon_factory(starter_store)
        r = generate(d.url, {**GREEDY, "rpc_servers": endpoint})
        assert r.status_code == 500 and endpoint in r.json()["error"], r.text
        assert "exit status" not in r.json()["error"]  # refused before ggml could abort
        assert generate(d.url, GREEDY).status_code == 200  # and the next request works
    finally:
        server.close()


def test_a_real_worker_passes_the_handshake(workers: list[tuple[str, Any]]) -> None:
    from corral.runner.tools.rpc import RPC_PROTO_MAJOR, probe

    assert probe(workers[0][0])[0] == RPC_PROTO_MAJOR


def test_a_stopped_worker_ends_the_stream_within_the_step_bound(
        starter_store: Store, daemon_factory: DaemonFactory,
        workers: list[tuple[str, subprocess.Popen[str]]]) -> None:
    """A worker that stops answering (SIGSTOP) holds llama_decode inside native code: the
    runner's step watch ends the stream with an error, `ps` answers meanwhile, and the
    next request gets a status (its load waits on the stopped worker until the load
    timeout), never a hang."""
    (endpoint, proc), _ = workers
    d = daemon_factory(starter_store, NUM_PARALLEL="1", STEP_TIMEOUT="10s",
                       LOAD_TIMEOUT="20s", RPC_SERVERS=endpoint)
    assert generate(d.url, SPLIT).status_code == 200
    lines: list[dict[str, Any]] = []
    try:
        with httpx.stream("POST", d.url + "/api/generate", timeout=300, json={
                "model": MODEL, "prompt": "Once upon a time",
                "options": {**SPLIT, "num_predict": 400}}) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if len(lines) == 2:
                    proc.send_signal(signal.SIGSTOP)
                    ps = httpx.get(d.url + "/api/ps", timeout=5)
                    assert ps.status_code == 200 and ps.json()["models"][0]["name"] == MODEL
        assert "stalled" in lines[-1]["error"] and not lines[-1].get("done")
        again = generate(d.url, SPLIT)
        assert again.status_code >= 500 and "error" in again.json()
    finally:
        proc.send_signal(signal.SIGCONT)
