"""`corral serve` as a user runs it: a real process that answers and exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

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
        wait_for(lambda: _answers(url), timeout=30)
        assert httpx.get(url).text == "Corral is running"
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
        # Its runners were stopped and reaped before it exited (RunnerProcess.stop waits
        # for them): none is left now, without waiting for their parent-death watch.
        for pid in runners:
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(
                f"/proc/{pid}/status").read().lower()
        assert "Listening on 127.0.0.1" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_warns_when_not_loopback(starter_store: Store) -> None:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"0.0.0.0:{port}",
               CORRAL_MODELS=str(starter_store.root), CORRAL_NOPRUNE="1")
    proc = subprocess.Popen([sys.executable, "-c", "from corral.cli.main import main; main()", "serve"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        # Answering means it is serving, so its SIGINT handler is in place.
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}"), timeout=30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "reachable from other machines" in (proc.stderr.read() if proc.stderr else "")


def test_runners_do_not_outlive_a_killed_daemon(starter_store: Store, tmp_path: Path) -> None:
    """A daemon killed with SIGKILL stops no runner; each notices on its own (its parent
    changed) and exits within seconds, though it holds a disk tier to write on the way."""
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(starter_store.root),
               CORRAL_NOPRUNE="1", CORRAL_CACHE_DISK="64MiB")
    umask = os.umask(0o022)  # what a user's shell has: the daemon must not rely on a tighter one
    try:
        proc = subprocess.Popen([sys.executable, "-m", "corral.server"], env=env,
                                stderr=subprocess.DEVNULL)
    finally:
        os.umask(umask)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url), timeout=30)
        # A prompt long enough to be kept: the runner has a slot state to write at its exit.
        r = httpx.post(url + "/api/generate", timeout=120, json={
            "model": "gemma3:270m-base", "prompt": "The river rises in the hills. " * 12,
            "options": {"num_predict": 1}, "stream": False})
        assert r.status_code == 200, r.text
        runners = _runners(proc.pid)
        assert runners
        proc.kill()  # no chance to stop its runners
        proc.wait(timeout=10)
        wait_for(lambda: not any(_alive(pid) for pid in runners), timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Whatever the runner wrote before it ended is its owner's alone.
    state = tmp_path / "home" / "state" / "corral"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for path in (state / "kvcache").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def _runners(daemon: int) -> list[int]:
    """The daemon's runner processes, from /proc (other tests' daemons may have theirs)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == daemon and b"corral.runner" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for init (or a subreaper) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_orphaned_runner_ends_even_when_its_stop_hangs() -> None:
    """The stop an orphan runs (engine, disk tier) gets a bounded time, then the process
    ends: here the stop never returns, and the end is called once the grace has passed."""
    from corral.runner.process.main import exit_with_parent

    ended: list[int] = []
    gone = threading.Event()

    def end(code: int) -> None:
        ended.append(code)
        gone.set()

    # parent=-1: no process has it, so the watch sees its daemon gone at once.
    watch = threading.Thread(target=exit_with_parent, daemon=True,
                             kwargs={"parent": -1, "shutdown": gone.wait, "grace": 0.05,
                                     "end": end})
    watch.start()
    assert gone.wait(timeout=30), "the orphan never ended"
    watch.join(timeout=30)
    assert ended == [1]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False
