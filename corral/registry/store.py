"""The content-addressed model store, laid out exactly as Ollama's.

    <root>/blobs/sha256-<hex>                         content-addressed layers
    <root>/manifests/<host>/<ns>/<model>/<tag>        manifest bytes, stored exactly

`blob_path` is the only function that turns a digest into a path; every read,
write and delete goes through it. Writes land in a temp file inside `blobs/`,
are hashed while streaming, fsynced, then atomically renamed, so nothing
half-written is ever visible under a digest name.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from corral.errors import CorralError, DigestMismatch, ModelNotFound, NoSpace
from corral.registry.gguf import GGUFInfo, inspect_gguf
from corral.registry.manifest import Manifest, canonical_digest, digest_hex, parse_manifest
from corral.registry.names import Name, parse_name

CHUNK = 1 << 20
FACTS_CACHED = 64  # GGUF headers kept in memory; each is a few KB plus its tensor table
TEMP_PREFIX = "tmp-"
PRUNE_AGE = 3600.0


@dataclass(frozen=True)
class ModelEntry:
    name: Name
    digest: str  # sha256 hex of the manifest bytes: the model ID
    size: int
    modified_at: float
    manifest: Manifest


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _raise_disk_error(exc: OSError) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise NoSpace("no space left on device") from exc
    raise exc


def file_sha256(path: Path) -> str:
    """`sha256:<hex>` of a file's content, read in chunks."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            hasher.update(block)
    return "sha256:" + hasher.hexdigest()


class Store:
    def __init__(self, root: Path, capacity: int | None = None) -> None:
        """`capacity`: the most bytes the blobs may take, below what the disk holds (a
        quota; the disk-full tests use it where no small filesystem can be mounted)."""
        if capacity is not None and capacity < 0:
            raise ValueError("a store's capacity cannot be negative")
        self.root = Path(root)
        self.capacity = capacity
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        # Manifest writes, copies, deletes and blob collection happen under one lock,
        # so concurrent create/copy/delete of one name never see each other half-done.
        self.lock = threading.RLock()
        self._facts: OrderedDict[str, GGUFInfo] = OrderedDict()
        self._facts_lock = threading.Lock()

    def gguf_info(self, digest: str) -> GGUFInfo:
        """What a model blob's GGUF header says, read once per digest.

        Blobs are content-addressed and never change in place, so the request
        path (capabilities, templates, show, slot sizing) never re-reads a file.
        """
        key = canonical_digest(digest)
        with self._facts_lock:
            if key in self._facts:
                self._facts.move_to_end(key)
                return self._facts[key]
        info = inspect_gguf(self.blob_path(key))
        with self._facts_lock:
            self._facts[key] = info
            while len(self._facts) > FACTS_CACHED:
                self._facts.popitem(last=False)
        return info

    # ---- blobs -------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """The one place a digest becomes a path: regex, resolve, containment check."""
        hex_digest = digest_hex(digest)
        blobs = Path(os.path.realpath(self.blobs))
        path = Path(os.path.realpath(blobs / f"sha256-{hex_digest}"))
        if os.path.commonpath([path, blobs]) != str(blobs) or path.parent != blobs:
            raise CorralError("blob path escapes the store")
        return path

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def blob_size(self, digest: str) -> int:
        return self.blob_path(digest).stat().st_size

    def read_blob(self, digest: str, limit: int = 1 << 24) -> bytes:
        """Small text/JSON layers. Large model blobs are opened by path instead."""
        path = self.blob_path(digest)
        try:
            with path.open("rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            raise ModelNotFound(f"blob {canonical_digest(digest)} is missing") from None
        if len(data) > limit:
            raise CorralError(f"layer {canonical_digest(digest)} is too large")
        return data

    def free_space(self) -> int:
        """Bytes the store can still take: the disk's free space, within the capacity."""
        self.blobs.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.blobs).free
        if self.capacity is None:
            return free
        with os.scandir(self.blobs) as entries:  # partial and temp files count: they are held
            used = sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
        return max(0, min(free, self.capacity - used))

    def temp_path(self) -> Path:
        self.blobs.mkdir(parents=True, exist_ok=True)
        return self.blobs / f"{TEMP_PREFIX}{uuid.uuid4().hex}"

    def write_blob(self, chunks: Iterable[bytes], expected: str | None = None) -> tuple[str, int]:
        """Stream chunks into the store. Returns (digest, size); verifies `expected` if given."""
        want = canonical_digest(expected) if expected is not None else None
        tmp = self.temp_path()
        hasher, size = hashlib.sha256(), 0
        room = self.free_space() if self.capacity is not None else None
        try:
            with open(tmp, "xb") as out:
                for chunk in chunks:
                    hasher.update(chunk)
                    size += len(chunk)
                    if room is not None and size > room:  # past the capacity: as a full disk
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = "sha256:" + hasher.hexdigest()
            if want is not None and digest != want:
                raise DigestMismatch(f"digest mismatch, expected {want}, got {digest}")
            final = self.blob_path(digest)
            os.replace(tmp, final)
            _sync_dir(self.blobs)
            return digest, size
        except OSError as exc:
            _raise_disk_error(exc)
            raise  # unreachable; keeps type checkers honest
        finally:
            tmp.unlink(missing_ok=True)

    def adopt(self, tmp: Path) -> tuple[str, int]:
        """Move a finished file from `temp_path()` into the store under its digest.

        The file is always gone afterwards: renamed into place, or deleted on failure.
        """
        try:
            digest, size = file_sha256(tmp), tmp.stat().st_size
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.blob_path(digest))
            _sync_dir(self.blobs)
            return digest, size
        except OSError as exc:
            _raise_disk_error(exc)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def write_blob_bytes(self, data: bytes, expected: str | None = None) -> tuple[str, int]:
        return self.write_blob([data], expected)

    def delete_blob(self, digest: str) -> None:
        self.blob_path(digest).unlink(missing_ok=True)

    # ---- manifests -----------------------------------------------------------

    def manifest_file(self, name: Name) -> Path:
        """Where `name`'s manifest lives (it may not exist)."""
        # A parsed Name has only safe characters, so the join cannot escape.
        return self.manifests.joinpath(*name.parts())

    def resolve(self, name: Name | str) -> Name | None:
        """The stored spelling of `name`, matched case-insensitively, or None."""
        if isinstance(name, str):
            name = parse_name(name)
        exact = self.manifest_file(name)
        if exact.is_file():
            return name
        for entry in self._manifest_names():
            if entry.key() == name.key():
                return entry
        return None

    def require(self, name: Name | str) -> Name:
        found = self.resolve(name)
        if found is None:
            shown = name if isinstance(name, str) else name.display()
            raise ModelNotFound(f"model '{shown}' not found")
        return found

    def read_manifest(self, name: Name | str) -> tuple[bytes, Manifest]:
        stored = self.require(name)
        data = self.manifest_file(stored).read_bytes()
        return data, parse_manifest(data)

    def write_manifest(self, name: Name, data: bytes) -> None:
        """Write manifest bytes exactly; replaces a differently-cased existing name."""
        with self.lock:
            manifest = parse_manifest(data)
            for digest in manifest.digests():
                if not self.has_blob(digest):
                    raise ModelNotFound(f"blob {digest} is missing")
            existing = self.resolve(name)
            if existing is not None and existing != name:
                self.manifest_file(existing).unlink(missing_ok=True)
            path = self.manifest_file(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "xb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
                _sync_dir(path.parent)
            except OSError as exc:
                _raise_disk_error(exc)
            finally:
                tmp.unlink(missing_ok=True)

    def _manifest_names(self) -> Iterator[Name]:
        # os.walk, not pathlib's glob: a delete on another thread removes directories
        # it emptied while this walks them, and glob raises when one vanishes.
        root = str(self.manifests)
        found: list[tuple[str, ...]] = []
        for top, dirs, files in os.walk(root):
            parts = os.path.relpath(top, root).split(os.sep)
            if len(parts) == 3:  # host/namespace/model: the files are its tags
                found += [(*parts, tag) for tag in files if not tag.startswith(".")]
                dirs.clear()
        for host, ns, model, tag in sorted(found):
            try:
                name = parse_name(f"{host}/{ns}/{model}:{tag}")
            except CorralError:
                continue
            yield name

    def _entry(self, name: Name) -> ModelEntry:
        path = self.manifest_file(name)
        data = path.read_bytes()
        manifest = parse_manifest(data)
        digest = hashlib.sha256(data).hexdigest()
        return ModelEntry(name, digest, manifest.size(), path.stat().st_mtime, manifest)

    def list_models(self) -> list[ModelEntry]:
        entries = []
        for name in self._manifest_names():
            try:
                entries.append(self._entry(name))
            except (OSError, CorralError):
                continue  # a foreign or broken manifest must not hide the others
        return entries

    def entry(self, name: Name | str) -> ModelEntry:
        stored = self.require(name)
        try:
            return self._entry(stored)
        except (OSError, CorralError):
            raise ModelNotFound(f"model '{stored.display()}' not found") from None

    def copy(self, source: Name | str, destination: Name) -> None:
        with self.lock:
            data, _ = self.read_manifest(source)
            self.write_manifest(destination, data)

    def delete(self, name: Name | str) -> None:
        """Remove a manifest, then every blob no other manifest references."""
        with self.lock:
            stored = self.require(name)
            _, manifest = self.read_manifest(stored)
            path = self.manifest_file(stored)
            path.unlink()
            self._remove_empty_dirs(path.parent)
            still_used = self.referenced_digests()
            for digest in manifest.digests() - still_used:
                self.delete_blob(digest)

    def referenced_digests(self) -> set[str]:
        used: set[str] = set()
        for name in self._manifest_names():
            try:
                used |= parse_manifest(self.manifest_file(name).read_bytes()).digests()
            except (OSError, CorralError):
                continue
        return used

    def _remove_empty_dirs(self, start: Path) -> None:
        current = start
        while current != self.manifests and self.manifests in current.parents:
            try:
                current.rmdir()
            except OSError:
                return
            current = current.parent

    def prune(self, max_age: float = PRUNE_AGE, now: Callable[[], float] = time.time) -> list[str]:
        """Remove unreferenced blobs and stale temp/partial files older than `max_age`."""
        with self.lock:
            removed: list[str] = []
            if not self.blobs.is_dir():
                return removed
            used = {digest_hex(d) for d in self.referenced_digests()}
            cutoff = now() - max_age
            for path in self.blobs.iterdir():
                try:
                    if not path.is_file() or path.stat().st_mtime > cutoff:
                        continue
                except OSError:
                    continue
                name = path.name
                is_blob = name.startswith("sha256-") and len(name) == 71
                if is_blob and name[7:] in used:
                    continue
                path.unlink(missing_ok=True)
                removed.append(name)
            if self.manifests.is_dir():
                for directory in sorted(self.manifests.rglob("*"), key=lambda p: -len(p.parts)):
                    if directory.is_dir():
                        try:
                            directory.rmdir()
                        except OSError:
                            pass
            return removed
