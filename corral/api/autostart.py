"""Starting a background daemon for the CLI, importing as little as possible.

`corral run MODEL` calls `spawn_early` before the CLI toolkit is even
imported, so the daemon (and, through `--preload`, the model's runner) starts
while the CLI is still loading; the client then waits for that same process.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from corral.config import Settings, state_dir
from corral.private import open_private, private_dir, write_private

_spawned: subprocess.Popen[bytes] | None = None  # the daemon this process started, if any


def may_autostart(settings: Settings) -> bool:
    """Only a daemon on this machine is ours to start; a remote one is never started."""
    return settings.host.is_loopback() or settings.host.host in ("0.0.0.0", "::")


def listening(settings: Settings, timeout: float = 0.2) -> bool:
    host = "127.0.0.1" if settings.host.host in ("0.0.0.0", "") else settings.host.host
    try:
        with socket.create_connection((host, settings.host.port), timeout=timeout):
            return True
    except OSError:
        return False


def spawned() -> bool:
    """Whether this process started the daemon."""
    return _spawned is not None


def log_path() -> Path:
    return state_dir() / "server.log"


def spawn(preload: str | None = None) -> subprocess.Popen[bytes]:
    """Start `python -m corral.server` in the background once per process; returns the process."""
    global _spawned
    if _spawned is not None:
        return _spawned
    # The log can quote requests (CORRAL_DEBUG): the folder and the file are private.
    log_dir = private_dir(state_dir())
    extra = ["--preload", preload] if preload else []
    with open_private(log_dir / "server.log", append=True) as log:
        # `python -m corral.server` is `corral serve` without the CLI toolkit's import time.
        # It runs in our own state directory, where no stray module can shadow ours.
        _spawned = subprocess.Popen([sys.executable, "-m", "corral.server", *extra], stdout=log,
                                    stderr=log, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(log_dir))
    write_private(log_dir / "server.pid", str(_spawned.pid).encode())
    return _spawned


def spawn_early(settings: Settings, model: str) -> None:
    """Start the daemon, preloading `model`, when nothing listens where the CLI will look."""
    if may_autostart(settings) and not listening(settings):
        spawn(preload=model)
