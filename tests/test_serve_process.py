"""`corral serve` as a user runs it: a real process that answers and exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from corral.registry.store import Store
from tests.support import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_and_stops_on_sigterm(starter_store: Store) -> None:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(starter_store.root),
               CORRAL_NOPRUNE="1")
    proc = subprocess.Popen([sys.executable, "-c", "from corral.cli.main import main; main()", "serve"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url).text == "Corral is running":
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        r = httpx.post(url + "/api/generate", timeout=120, json={
            "model": "gemma3:270m-base", "prompt": "Hello", "stream": False,
            "options": {"num_predict": 3}})
        assert r.status_code == 200 and r.json()["eval_count"] == 3
        # This daemon's own runners: other tests' daemons may have theirs alive too.
        runners = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "runner --config"],
                                 capture_output=True, text=True).stdout.split()
        assert runners
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        time.sleep(0.5)
        for pid in runners:
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(
                f"/proc/{pid}/status").read().lower()
        assert "Listening on 127.0.0.1" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_warns_when_not_loopback(starter_store: Store) -> None:
    env = dict(os.environ, CORRAL_HOST=f"0.0.0.0:{free_port()}",
               CORRAL_MODELS=str(starter_store.root), CORRAL_NOPRUNE="1")
    proc = subprocess.Popen([sys.executable, "-c", "from corral.cli.main import main; main()", "serve"],
                            env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "reachable from other machines" in (proc.stderr.read() if proc.stderr else "")


def test_runners_do_not_outlive_a_killed_daemon(starter_store: Store) -> None:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(starter_store.root),
               CORRAL_NOPRUNE="1")
    proc = subprocess.Popen([sys.executable, "-m", "corral.server"], env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url), timeout=30)
        r = httpx.post(url + "/api/generate", json={"model": "gemma3:270m-base"}, timeout=120)
        assert r.json()["done_reason"] == "load"
        runners = [p for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                             text=True).stdout.split()]
        assert runners
        proc.kill()  # no chance to stop its runners
        proc.wait(timeout=10)
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") and "zombie" not in open(
            f"/proc/{pid}/status").read().lower() for pid in runners), timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False
