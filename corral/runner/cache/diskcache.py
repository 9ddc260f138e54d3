"""The prompt cache's disk tier (CORRAL_CACHE_DISK): KV states that outlive the process.

Host memory goes with the runner, so after keep-alive unloads a model, or the daemon
restarts, a conversation would start from nothing. When the runner stops, and when the
RAM cache evicts for room, entries are written here, under the state directory; a
lookup that finds a longer prefix here than in RAM reads it back, on a helper thread
while the other slots decode (runner.cache.diskread); everything else is the engine thread's.

Each file is one entry: a magic line, a JSON header (the namespace, the tokens, the
data's length and SHA-256) and the state. The namespace is a hash of everything that
changes the KV besides the tokens: the model file, adapters, KV type, context and
kernel parameters, the llama.cpp version. An entry whose namespace differs, whose
header does not parse, whose data is short or whose hash does not match is removed
and never loaded: llama.cpp trusts the bytes it is given. Files are written to a
temporary name and renamed, so a crash leaves no half entry under a real name; the
oldest (by last use) go first when the tier is over its size. The headers list prompts,
so files are 0600 in 0700 folders from creation (corral.private), and older ones are
tightened when the tier opens.

In the runner the files are written on a writer thread (background): the engine hands
over the state's bytes, which nobody changes after, and goes on decoding while they are
hashed and written; the index stays the engine thread's, which takes in the finished
writes at its next lookup or save. An entry is found once written; a state whose tokens
are queued is not queued twice, and one that would take the queue past MAX_QUEUED bytes
is let go, as a full disk lets it go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from corral.private import open_private, private_dir, tighten
from corral.runner.prefix import Checkpoints, common_prefix

log = logging.getLogger("corral.diskcache")
MAGIC = b"CORRAL-KV 1\n"
# An entry with checkpoints (where the memory cannot be cut) after its state: a Corral that knows
# only MAGIC removes it rather than hand llama.cpp the state with them
MAGIC_CHECKPOINTS = b"CORRAL-KV 2\n"
MAX_HEADER = 4 << 20  # a header lists tokens as JSON; far more than any num_ctx needs
MAX_QUEUED = 1 << 30  # bytes of states waiting for the writer thread
GATE_WAIT = 300.0  # seconds a test's gate may hold a write


def namespace(identity: dict[str, Any]) -> str:
    """A stable name for everything besides the tokens that the KV depends on."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Read:
    """What reading an entry gave: its state, or None and why not."""

    data: bytes | None
    problem: str = ""
    checkpoints: Checkpoints = ()


@dataclass(eq=False)  # an entry is itself: compared by identity, as `entries` holds it
class DiskEntry:
    tokens: tuple[int, ...]
    path: Path
    size: int  # bytes on disk
    used: float  # last use (the file's mtime)
    marks: tuple[int, ...] = ()  # where its checkpoints are (tokens)


Key = tuple[int, ...]


class DiskTier:
    """`background` writes files on a writer thread; `gate`, for tests, holds each write
    until it is set."""

    def __init__(self, root: Path, budget: int, space: str, background: bool = False,
                 gate: threading.Event | None = None) -> None:
        self.dir = root / space
        self.budget, self.space, self.gate, self.background = budget, space, gate, background
        self._queued: dict[Key, int] = {}  # tokens -> bytes handed to the writer, not taken in
        self._todo: queue.Queue[tuple[Key, bytes | bytearray, Checkpoints]] = queue.Queue()
        self._written: queue.Queue[tuple[Key, Path | None, tuple[int, ...]]] = queue.Queue()
        private_dir(root)
        private_dir(self.dir)
        self.entries: list[DiskEntry] = []
        self.rejected = 0  # files removed as corrupt, truncated or foreign
        loose = 0
        for path in sorted(self.dir.glob("*.kv")):
            loose += tighten(path, quiet=True)  # one line for them all, below
            entry = self._index(path)
            if entry is not None:
                self.entries.append(entry)
        if loose:
            log.warning("%d prompt cache files in %s were readable by others; made them "
                        "0600", loose, self.dir)
        for stray in self.dir.glob("*.tmp"):  # a write that a crash cut short
            stray.unlink(missing_ok=True)
        self._evict()
        if background:
            threading.Thread(target=self._writer, daemon=True, name="kv-disk-writer").start()

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def lookup(self, tokens: Sequence[int]) -> tuple[DiskEntry | None, int]:
        self._collect()
        best, best_n = None, 0
        for entry in self.entries:
            n = common_prefix(entry.tokens, tokens)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def read(self, entry: DiskEntry) -> "Read":
        """The entry's state, verified, or why not. Only reads: safe on any thread while
        the engine thread uses the tier (runner.cache.diskread), which then calls `settle`.
        A file replaced or removed meanwhile is read whole or not at all (writes rename
        over it, removals unlink it: an open file keeps its bytes), and is checked like
        any other: its namespace, its tokens (a file swapped with another entry's holds
        another prefix), its length and its hash."""
        try:
            with entry.path.open("rb") as f:
                header = _read_header(f)
                data = f.read()
        except (OSError, ValueError) as exc:
            return Read(None, f"unreadable: {exc}")
        if header.get("space") != self.space or header.get("tokens") != list(entry.tokens):
            return Read(None, "not this entry of this model and configuration")
        if header.get("size") != len(data) or hashlib.sha256(data).hexdigest() != header.get(
                "sha256"):
            return Read(None, "its data does not match its header")
        marks = _marks(header)
        state = len(data) - sum(size for _, size in marks) if marks is not None else 0
        if marks is None or state <= 0:
            return Read(None, "its checkpoints do not match its data")
        checkpoints, at = [], state
        for n, size in marks:
            checkpoints.append((n, data[at:at + size]))
            at += size
        return Read(data[:state] if marks else data, checkpoints=tuple(checkpoints))

    def settle(self, entry: DiskEntry, read: "Read") -> bytes | None:
        """On the tier's own thread, after `read`: the data, and the entry is the most
        recently used; or None, and the file is removed, never to be loaded. An entry that
        went meanwhile (evicted, or extended by a newer one) changes nothing here."""
        if entry not in self.entries:
            return read.data
        if read.data is None:
            self._reject(entry.path, read.problem)
            return None
        try:
            os.utime(entry.path)
            entry.used = entry.path.stat().st_mtime
        except OSError:  # removed by hand meanwhile: the bytes read are still whole
            pass
        return read.data

    def load(self, entry: DiskEntry) -> bytes | None:
        """The entry's state, verified; None (and the file removed) when it is not whole."""
        return self.settle(entry, self.read(entry))

    def save(self, tokens: Sequence[int], data: bytes | bytearray,
             checkpoints: Checkpoints = ()) -> bool:
        """Keep a state, and its checkpoints (handed to the writer, in the background);
        False when it is not."""
        self._collect()
        key = tuple(tokens)
        if not data or len(data) > self.budget or any(
                e.tokens[:len(key)] == key for e in self.entries) or any(
                q[:len(key)] == key for q in self._queued):
            return False
        marks = tuple(n for n, _ in checkpoints)
        if not self.background:
            return self._kept(key, self._write(key, data, checkpoints), marks)
        if self._queued and sum(self._queued.values()) + len(data) > MAX_QUEUED:
            return False
        self._queued[key] = len(data)
        self._todo.put((key, data, checkpoints))
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every state handed to the writer is written and taken in; False
        when `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._queued:
            try:
                self._kept(*self._written.get(timeout=max(deadline - time.monotonic(), 1e-3)))
            except queue.Empty:
                return False
        return True

    def _collect(self) -> None:
        """Take in the writes that finished."""
        while self._queued:
            try:
                self._kept(*self._written.get_nowait())
            except queue.Empty:
                return

    def _kept(self, key: Key, path: Path | None, marks: tuple[int, ...] = ()) -> bool:
        self._queued.pop(key, None)
        try:
            st = path.stat() if path is not None else None
        except OSError:  # removed meanwhile
            st = None
        if path is None or st is None:
            return False
        # Shorter entries this one extends hold nothing it does not.
        for old in [e for e in self.entries if e.tokens == key[:len(e.tokens)]]:
            self._drop(old)
        self.entries.append(DiskEntry(key, path, st.st_size, st.st_mtime, marks))
        self._evict()
        return True

    def _writer(self) -> None:
        while True:
            key, data, checkpoints = self._todo.get()
            try:
                path = self._write(key, data, checkpoints)
            except Exception:  # a bug here costs the entry, never the writer
                log.exception("prompt cache writer")
                path = None
            self._written.put((key, path, tuple(n for n, _ in checkpoints)))

    def _write(self, key: Key, data: bytes | bytearray,
               checkpoints: Checkpoints = ()) -> Path | None:
        """The entry's file (any thread: it touches the file alone); None when not written.
        Its checkpoints follow the state, each as long as the header says."""
        if self.gate is not None:
            self.gate.wait(GATE_WAIT)
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
        path, tmp = self.dir / f"{name}.kv", self.dir / f"{name}.tmp"
        digest = hashlib.sha256(data)
        for _, state in checkpoints:
            digest.update(state)
        fields: dict[str, Any] = {"space": self.space, "tokens": list(key),
                                  "size": len(data) + sum(len(c) for _, c in checkpoints),
                                  "sha256": digest.hexdigest()}
        if checkpoints:
            fields["checkpoints"] = [[n, len(c)] for n, c in checkpoints]
        header = json.dumps(fields).encode()
        try:
            with open_private(tmp) as f:
                f.write((MAGIC_CHECKPOINTS if checkpoints else MAGIC)
                        + len(header).to_bytes(4, "little") + header)
                f.write(data)
                for _, state in checkpoints:
                    f.write(state)
            os.replace(tmp, path)
        except OSError as exc:  # a full disk costs the entry, never the request
            log.warning("could not write a prompt cache entry: %s", exc)
            tmp.unlink(missing_ok=True)
            return None
        return path

    def _index(self, path: Path) -> DiskEntry | None:
        try:
            with path.open("rb") as f:
                header = _read_header(f)
            st = path.stat()
        except (OSError, ValueError) as exc:
            self._reject(path, f"unreadable: {exc}")
            return None
        tokens = header.get("tokens")
        if header.get("space") != self.space or not isinstance(tokens, list) \
                or not all(isinstance(t, int) for t in tokens):
            self._reject(path, "not an entry of this model and configuration")
            return None
        marks = _marks(header)
        if marks is None:
            self._reject(path, "its checkpoints do not parse")
            return None
        return DiskEntry(tuple(tokens), path, st.st_size, st.st_mtime,
                         tuple(n for n, _ in marks))

    def _reject(self, path: Path, why: str) -> None:
        log.warning("removing prompt cache file %s: %s", path.name, why)
        self.rejected += 1
        path.unlink(missing_ok=True)
        self.entries = [e for e in self.entries if e.path != path]

    def _drop(self, entry: DiskEntry) -> None:
        entry.path.unlink(missing_ok=True)
        self.entries.remove(entry)

    def _evict(self) -> None:
        """CORRAL_CACHE_DISK bounds the whole tier, every model's entries together: the
        least recently used go first, whichever model they belong to."""
        others = [p for p in self.dir.parent.glob("*/*.kv") if p.parent != self.dir]
        total = self.size + sum(_size(p) for p in others)
        candidates = [(e.used, e.size, e) for e in self.entries] + [
            (_mtime(p), _size(p), p) for p in others]
        for _, size, victim in sorted(candidates, key=lambda c: c[0]):
            if total <= self.budget:
                break
            total -= size
            if isinstance(victim, DiskEntry):
                self._drop(victim)
            else:
                victim.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _marks(header: dict[str, Any]) -> list[tuple[int, int]] | None:
    """The header's checkpoints, as (tokens, bytes); None where they do not parse."""
    marks = header.get("checkpoints", [])
    if not isinstance(marks, list) or not all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(x, int) and x > 0 for x in m)
            for m in marks):
        return None
    return [(n, size) for n, size in marks]


def _read_header(f: Any) -> dict[str, Any]:
    if f.read(len(MAGIC)) not in (MAGIC, MAGIC_CHECKPOINTS):
        raise ValueError("not a prompt cache file")
    n = int.from_bytes(f.read(4), "little")
    if n <= 0 or n > MAX_HEADER:
        raise ValueError("bad header length")
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("bad header")
    return header
