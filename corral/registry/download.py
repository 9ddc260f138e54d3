"""Resumable, verified blob downloads in parallel ranged parts, shared between pulls.

Progress lives in `sha256-<hex>-partial` (the data, pre-sized) and one
`sha256-<hex>-partial-<N>` JSON file per part, so a download resumes where it
stopped after a dropped connection, a Ctrl-C or a daemon restart. The blob is
sha256-verified before it is renamed into place.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from corral.errors import CorralError, DigestMismatch, NoSpace
from corral.registry.manifest import digest_hex
from corral.registry.store import Store, file_sha256

log = logging.getLogger("corral.download")


@dataclass(frozen=True)
class DownloadOptions:
    parts: int = 4  # concurrent ranged requests per blob
    part_size: int = 100 << 20  # bytes per part; fewer parts for small blobs
    stall_timeout: float = 30.0  # seconds without a byte before a part restarts
    retries: int = 6
    backoff: float = 1.0  # first retry delay, doubling
    chunk: int = 1 << 16


@dataclass
class Part:
    n: int
    offset: int
    size: int
    completed: int = 0

    def to_json(self) -> dict[str, int]:
        return {"N": self.n, "Offset": self.offset, "Size": self.size, "Completed": self.completed}


class IgnoresRange(Exception):
    """The server answered a ranged request with the whole body."""


class Stalled(Exception):
    pass


@dataclass
class Download:
    """One blob being fetched; any number of pulls may wait on it."""

    digest: str
    total: int
    done: threading.Event = field(default_factory=threading.Event)
    error: CorralError | None = None
    waiters: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    parts: list[Part] = field(default_factory=list)
    requests: int = 0  # ranged GETs made; tests read it

    @property
    def completed(self) -> int:
        return sum(p.completed for p in self.parts)


class Downloader:
    """Runs downloads and makes concurrent pulls of one digest share a single download."""

    def __init__(self, store: Store, options: DownloadOptions = DownloadOptions()) -> None:
        self.store = store
        self.options = options
        self.lock = threading.Lock()
        self.active: dict[str, Download] = {}

    def join(self, digest: str, total: int, url: str,
             headers: dict[str, str] | None = None) -> Download:
        """The running download of `digest`, or a new one started on `url`.

        The download owns its HTTP client, so it outlives the pull that started it.
        """
        with self.lock:
            dl = self.active.get(digest)
            if dl is None:
                dl = Download(digest, total)
                self.active[digest] = dl
                threading.Thread(target=self._run, args=(dl, url, dict(headers or {})),
                                 daemon=True).start()
            dl.waiters += 1
            return dl

    def leave(self, dl: Download) -> None:
        """A waiter gave up; with none left the download stops (its partial files stay)."""
        with self.lock:
            dl.waiters -= 1
            if dl.waiters <= 0 and not dl.done.is_set():
                dl.cancelled.set()

    # ---- the download itself ---------------------------------------------------------------

    def _paths(self, digest: str) -> tuple[Path, Path]:
        final = self.store.blob_path(digest)  # validates the digest: nothing else is a path
        return final, final.with_name(final.name + "-partial")

    def _run(self, dl: Download, url: str, headers: dict[str, str]) -> None:
        client = httpx.Client(trust_env=True, headers=headers, follow_redirects=True)
        try:
            self._download(dl, url, client)
        except CorralError as exc:
            dl.error = exc
        except Exception as exc:  # noqa: BLE001 - reported to every waiter
            log.exception("download of %s failed", dl.digest)
            dl.error = CorralError(f"download failed: {exc}")
        finally:
            client.close()
            with self.lock:
                self.active.pop(dl.digest, None)
            dl.done.set()

    def _load_parts(self, partial: Path, total: int) -> list[Part]:
        parts = []
        for state in sorted(partial.parent.glob(partial.name + "-*")):
            try:
                doc = json.loads(state.read_text())
                part = Part(int(doc["N"]), int(doc["Offset"]), int(doc["Size"]),
                            int(doc["Completed"]))
            except (OSError, ValueError, KeyError, TypeError):
                return []
            parts.append(part)
        parts.sort(key=lambda p: p.offset)
        covered = sum(p.size for p in parts)
        valid = all(0 <= p.completed <= p.size for p in parts)
        if not parts or covered != total or not valid or not partial.exists() \
                or partial.stat().st_size != total:
            return []
        return parts

    def _plan(self, total: int) -> list[Part]:
        size = max(self.options.part_size, -(-total // max(self.options.parts, 1)) if total else 1)
        parts: list[Part] = []
        offset, n = 0, 0
        while offset < total or not parts:
            length = min(size, total - offset)
            parts.append(Part(n, offset, length))
            offset += length
            n += 1
            if total == 0:
                break
        return parts

    def _save(self, partial: Path, part: Part) -> None:
        state = partial.with_name(f"{partial.name}-{part.n}")
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(json.dumps(part.to_json()))
        os.replace(tmp, state)

    def _clear_state(self, partial: Path) -> None:
        for state in partial.parent.glob(partial.name + "-*"):
            state.unlink(missing_ok=True)

    def _download(self, dl: Download, url: str, client: httpx.Client) -> None:
        final, partial = self._paths(dl.digest)
        partial.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            dl.parts = [Part(0, 0, dl.total, dl.total)]
            return
        parts = self._load_parts(partial, dl.total)
        try:
            if not parts:
                self._clear_state(partial)
                # A layer that cannot fit fails now, as a full disk would, not after it
                # has downloaded as much as fits.
                if self.store.free_space() < dl.total:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                with open(partial, "wb") as f:
                    f.truncate(dl.total)
                parts = self._plan(dl.total)
                for part in parts:
                    self._save(partial, part)
            dl.parts = parts
            self._fetch_parts(dl, url, client, partial)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                partial.unlink(missing_ok=True)
                self._clear_state(partial)
                raise NoSpace("no space left on device") from None
            raise
        if dl.cancelled.is_set():
            raise CorralError("download cancelled")
        self._verify_and_commit(dl, partial, final)

    def _fetch_parts(self, dl: Download, url: str, client: httpx.Client, partial: Path) -> None:
        errors: list[BaseException] = []
        abort = threading.Event()

        def worker(part: Part) -> None:
            try:
                self._fetch_part(dl, part, url, client, partial, abort)
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
                abort.set()

        threads = [threading.Thread(target=worker, args=(p,), daemon=True)
                   for p in dl.parts if p.completed < p.size]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ignores = [e for e in errors if isinstance(e, IgnoresRange)]
        if ignores and not dl.cancelled.is_set():
            # The server only sends whole bodies: start over as one part, from byte 0.
            self._clear_state(partial)
            dl.parts = [Part(0, 0, dl.total)]
            self._save(partial, dl.parts[0])
            self._fetch_part(dl, dl.parts[0], url, client, partial, threading.Event(),
                             ranged=False)
            return
        for exc in errors:
            raise exc

    def _fetch_part(self, dl: Download, part: Part, url: str, client: httpx.Client,
                    partial: Path, abort: threading.Event, ranged: bool = True) -> None:
        failures = 0
        while part.completed < part.size and not dl.cancelled.is_set() and not abort.is_set():
            try:
                self._stream_part(dl, part, url, client, partial, ranged)
            except Stalled:
                log.warning("part %d of %s stalled; restarting it", part.n, dl.digest[:19])
            except (httpx.HTTPError, CorralError) as exc:
                failures += 1
                if failures > self.options.retries:
                    raise CorralError(f"download failed after {failures} tries: {exc}") from None
                delay = self.options.backoff * 2 ** (failures - 1)
                log.warning("part %d of %s: %s; retrying in %.1fs", part.n, dl.digest[:19],
                            exc, delay)
                dl.cancelled.wait(delay)
            finally:
                self._save(partial, part)

    def _stream_part(self, dl: Download, part: Part, url: str, client: httpx.Client,
                     partial: Path, ranged: bool) -> None:
        start = part.offset + part.completed
        end = part.offset + part.size - 1
        headers = {"Range": f"bytes={start}-{end}"} if ranged else {}
        headers["Accept-Encoding"] = "identity"
        timeout = httpx.Timeout(self.options.stall_timeout, connect=10.0)
        dl.requests += 1
        with client.stream("GET", url, headers=headers, timeout=timeout) as resp:
            if ranged and resp.status_code == 200 and (start > 0 or part.size != dl.total):
                raise IgnoresRange()
            if resp.status_code not in (200, 206):
                raise CorralError(f"unexpected status {resp.status_code} downloading blob")
            if resp.headers.get("content-encoding", "identity") not in ("identity", ""):
                raise CorralError("the registry sent a compressed blob; refusing it")
            fd = os.open(partial, os.O_WRONLY)
            try:
                try:
                    for data in resp.iter_raw(self.options.chunk):
                        if dl.cancelled.is_set():
                            return
                        room = part.size - part.completed
                        data = data[:room]
                        os.pwrite(fd, data, part.offset + part.completed)
                        part.completed += len(data)
                        if part.completed >= part.size:
                            break
                except httpx.ReadTimeout:
                    raise Stalled() from None
            finally:
                os.close(fd)
        if part.completed < part.size and not dl.cancelled.is_set():
            raise CorralError("connection closed before the part was complete")

    def _verify_and_commit(self, dl: Download, partial: Path, final: Path) -> None:
        got = file_sha256(partial)
        if digest_hex(got) != digest_hex(dl.digest):
            partial.unlink(missing_ok=True)
            self._clear_state(partial)
            raise DigestMismatch(
                f"digest mismatch, file must be downloaded again: want {dl.digest}, got {got}")
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, final)
        self._clear_state(partial)


def wait(dl: Download, on_progress: Callable[[Download], None], interval: float = 0.1,
         cancelled: Callable[[], bool] = lambda: False) -> None:
    """Report progress until the download ends; raises its error."""
    while not dl.done.wait(interval):
        if cancelled():
            raise CorralError("pull cancelled")
        on_progress(dl)
    on_progress(dl)
    if dl.error is not None:
        raise dl.error
