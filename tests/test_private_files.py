"""What people typed stays theirs: the prompt cache's disk tier, the REPL's history and the
state folder are 0600 files in 0700 folders, whatever the umask, and a looser one found
there is tightened and logged.

Each test runs under a permissive umask (022, a common default), so a file made without
an explicit mode would come out 0644 and the test would see it."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import Iterator

import pexpect
import pytest

from corral.private import open_private, private_dir, write_private
from corral.runner.cache.diskcache import DiskTier
from corral.server.daemon import Daemon


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def loose_file(path: Path, text: str = "") -> Path:
    path.write_text(text)
    path.chmod(0o644)
    return path


def test_new_files_and_folders_are_private(tmp_path: Path) -> None:
    folder = private_dir(tmp_path / "shared" / "corral")
    assert mode(folder) == 0o700
    assert mode(folder.parent) == 0o755  # a parent is a shared folder, left as it is
    with open_private(folder / "log", append=True) as f:
        f.write(b"a line\n")
    write_private(folder / "pid", b"42")
    assert mode(folder / "log") == mode(folder / "pid") == 0o600
    assert (folder / "pid").read_bytes() == b"42" and sorted(os.listdir(folder)) == ["log", "pid"]


def test_a_loose_file_or_folder_is_tightened_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    log = loose_file(folder / "server.log", "earlier\n")
    with caplog.at_level(logging.WARNING, logger="corral.private"):
        private_dir(folder)
        with open_private(log, append=True) as f:
            f.write(b"later\n")
        log.chmod(0o644)  # loosened again: tightened again, but said only once
        open_private(log, append=True).close()
    assert mode(folder) == 0o700 and mode(log) == 0o600
    assert log.read_text() == "earlier\nlater\n"  # appending keeps what was there
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert str(folder) in said[0] and "755" in said[0]
    assert str(log) in said[1] and "644" in said[1] and "600" in said[1]


def test_the_disk_tier_tightens_what_an_older_version_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kvcache"
    first = DiskTier(root, 1 << 20, "space")
    assert first.save([1, 2, 3], b"state bytes")
    [entry] = first.entries
    assert mode(root) == mode(root / "space") == 0o700 and mode(entry.path) == 0o600
    root.chmod(0o755)
    (root / "space").chmod(0o755)
    entry.path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        again = DiskTier(root, 1 << 20, "space")
    assert [e.tokens for e in again.entries] == [(1, 2, 3)]
    assert mode(root) == mode(root / "space") == 0o700 and mode(entry.path) == 0o600
    assert any("1 prompt cache files" in r.getMessage() for r in caplog.records)


@pytest.mark.model
def test_a_real_engine_writes_its_disk_tier_private(chat_gguf: Path, tmp_path: Path) -> None:
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine
    from corral.runner.jobs import Done, Job, SamplingParams

    root = tmp_path / "state" / "kvcache"
    engine = Engine(str(chat_gguf), EngineConfig(
        n_slots=1, num_ctx=512, cache_ram=16 << 20, cache_disk=64 << 20, cache_dir=str(root)))
    engine.start()
    try:
        prompt = engine.tokenize("A secret the user typed, told at length. " * 8)
        job = engine.submit(Job(prompt=prompt, params=SamplingParams(temperature=0),
                                num_predict=1))
        while not isinstance(job.events.get(timeout=300), Done):
            pass
    finally:
        engine.stop()  # an unload: the slot's state goes to the disk tier
    written = list(root.rglob("*.kv"))
    assert written, "the engine wrote no disk entry"
    assert {mode(p) for p in written} == {0o600}
    assert {mode(p) for p in [root, *root.iterdir()]} == {0o700}


def test_a_repl_session_keeps_its_history_private(daemon: Daemon, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "corral").mkdir(parents=True, mode=0o755)
    history = loose_file(state / "corral" / "history", "an earlier line\n")
    host, port = daemon.address
    env = dict(os.environ, CORRAL_HOST=f"{host}:{port}", XDG_STATE_HOME=str(state))
    child = pexpect.spawn(sys.executable, ["-c", "from corral.cli.launch import main; main()",
                                           "run", "smollm2:135m"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 100))
    child.expect("readable by others")  # the tightening is said where the user sees it
    child.expect(">>> ")
    child.sendline("/set parameter num_predict 1")
    child.expect(">>> ")
    child.sendline("a private question")
    child.expect(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "a private question" in history.read_text()
    assert mode(state / "corral") == 0o700 and mode(history) == 0o600
