"""Files that hold what people typed or were told, readable by their owner alone.

Prompts and answers reach the disk in a few places: the prompt cache's disk tier (each
entry's header lists a prompt's tokens), the REPL's history, and the daemon's log in the
state directory (at debug level a runner's or a route's messages can quote a request).
Each is created 0600 in a 0700 folder: the mode is given to `open`/`mkdir` themselves,
so there is no moment when the umask's looser mode lets another user open the file. One
found looser (made by an older Corral, or by hand) is tightened, and that is logged once
per path. The model store is not among them: like Ollama's models folder it is shared
content (a Modelfile's SYSTEM or MESSAGE layers included), laid out as Ollama lays it out.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700
OPEN_TO_OTHERS = 0o077  # group and other bits: what tightening takes away

log = logging.getLogger("corral.private")
_lock = threading.Lock()
_reported: set[str] = set()  # paths whose tightening was logged (once each)


def tighten(path: Path | str, fd: int | None = None, quiet: bool = False) -> bool:
    """Take the group and other bits off `path` (through `fd` when it is open); True when
    there were any. Logged once per path unless `quiet` (a caller that tightens many files
    logs one line for them all). A file we may not chmod is logged and left as it is."""
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode if fd is not None else os.stat(path).st_mode)
        if not mode & OPEN_TO_OTHERS:
            return False
        if fd is not None:
            os.fchmod(fd, mode & ~OPEN_TO_OTHERS)
        else:
            os.chmod(path, mode & ~OPEN_TO_OTHERS)
    except OSError as exc:
        log.warning("could not make %s private: %s", path, exc)
        return False
    with _lock:
        first = str(path) not in _reported
        _reported.add(str(path))
    if first and not quiet:
        log.warning("%s was readable by others (mode %03o); made it %03o", path, mode,
                    mode & ~OPEN_TO_OTHERS)
    return True


def private_dir(path: Path) -> Path:
    """`path` as a folder only its owner can open: made 0700, or tightened. Missing parents
    get the usual mode: they are shared folders (`~/.local/state`), not ours."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        tighten(path)
    return path


def open_private(path: Path, append: bool = False) -> BinaryIO:
    """`path` opened for writing (truncated, or appended to), created 0600; an existing
    file that others could read is tightened before anything is written."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        tighten(path, fd)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` whole with `data`: written to a 0600 file beside it and renamed, so a
    reader (or a crash) sees the old content or the new, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
