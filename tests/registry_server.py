"""A real registry on loopback for pull and push tests: /v2 manifests and blobs from memory,
blob downloads redirected to a second "CDN" port, the upload protocol (HEAD, POST with
cross-repository mount, PATCH, PUT ?digest=, PUT manifest), a bearer challenge for
`private/*`, and switches that make it misbehave."""

from __future__ import annotations

import gzip
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from corral.registry import manifest as mt
from tests import registry_upload as upload


@dataclass
class Faults:
    drop_at: list[int] = field(default_factory=list)  # cumulative blob bytes; drop once at each
    stall_once: float = 0.0  # seconds a blob response stalls before its first byte
    ignore_range: bool = False
    corrupt: bool = False
    redirect_status: int = 307
    no_redirect: bool = False
    foreign_realm: bool = False
    gzip_manifest: bool = False
    blob_delay: float = 0.0  # seconds between chunks, to keep a download busy
    # Blobs whose responses hold before their first byte until the test opens the gate
    # (a deadline of a minute, so a failed test never hangs the registry).
    gates: dict[str, threading.Event] = field(default_factory=dict)
    # Once this many blob bytes are sent, every blob response holds before its next chunk
    # until `resume` is set (a minute at most): a download stopped part-way, at any speed.
    hold_after: int = 0
    resume: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)  # set once it holds
    drop_upload_at: list[int] = field(default_factory=list)  # upload bytes; drop once at each


@dataclass
class Stats:
    blob_bytes: int = 0
    by_digest: dict[str, int] = field(default_factory=dict)  # blob bytes sent, per blob
    blob_requests: int = 0
    ranges: list[str] = field(default_factory=list)
    token_requests: int = 0
    upload_bytes: int = 0
    uploads: int = 0  # upload sessions opened
    mounts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up mid-blob is what these tests do


class FakeRegistry:
    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str, str], bytes] = {}
        self.blobs: dict[str, Path | bytes] = {}
        self.repo_blobs: dict[tuple[str, str], set[str]] = {}  # what HEAD finds, per repository
        self.sessions: dict[str, tuple[tuple[str, str], bytearray]] = {}
        self.faults = Faults()
        self.stats = Stats()
        self.token = "tok-123"
        self.cdn = self._serve(_CdnHandler)
        self.registry = self._serve(_RegistryHandler)

    def _serve(self, handler: type) -> ThreadingHTTPServer:
        server = _Quiet(("127.0.0.1", 0), type("H", (handler,), {"reg": self}))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.registry.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def add_blob(self, data: bytes | Path) -> tuple[str, int]:
        if isinstance(data, Path):
            h = hashlib.sha256()
            with data.open("rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            size = data.stat().st_size
        else:
            h, size = hashlib.sha256(data), len(data)
        digest = "sha256:" + h.hexdigest()
        self.blobs[digest] = data
        return digest, size

    def add_model(self, ns: str, model: str, tag: str, layers: list[tuple[str, bytes | Path]]
                  ) -> bytes:
        entries = []
        for media, data in layers:
            digest, size = self.add_blob(data)
            entries.append({"mediaType": media, "digest": digest, "size": size})
        cdigest, csize = self.add_blob(json.dumps({"model_format": "gguf",
                                                   "model_family": "gemma3"}).encode())
        self.repo_blobs.setdefault((ns, model), set()).update(
            [cdigest, *(str(e["digest"]) for e in entries)])
        doc = {"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE,
               "config": {"mediaType": mt.CONFIG_MEDIA_TYPE, "digest": cdigest, "size": csize},
               "layers": entries}
        raw = json.dumps(doc, indent=2).encode()  # not our own formatting: stored byte-exact
        self.manifests[(ns, model, tag)] = raw
        return raw

    def blob_bytes(self, digest: str) -> bytes:
        data = self.blobs[digest]
        if isinstance(data, Path):  # read a file once, then serve it from memory
            data = self.blobs[digest] = data.read_bytes()
        return data

    def close(self) -> None:
        for server in (self.registry, self.cdn):
            server.shutdown()
            server.server_close()


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    reg: FakeRegistry

    def log_message(self, fmt: str, *args: Any) -> None:
        pass

    def send_bytes(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _RegistryHandler(_Base):
    def _route(self) -> tuple[str, str, str, str] | None:
        """(namespace, model, kind, ref) of a /v2 path once any bearer challenge is met."""
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) in (5, 6) and parts[3:5] == ["blobs", "uploads"]:
            parts = [*parts[:3], "uploads", parts[5] if len(parts) == 6 else ""]
        if len(parts) != 5 or parts[0] != "v2":
            self.send_bytes(404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}')
            return None
        _, ns, model, kind, ref = parts
        if ns == "private" and self.headers.get("Authorization") != f"Bearer {self.reg.token}":
            realm_host = "evil.example.com:9999" if self.reg.faults.foreign_realm \
                else self.reg.host
            action = "pull" if self.command in ("GET", "HEAD") else "push,pull"
            self.send_bytes(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                "WWW-Authenticate": f'Bearer realm="http://{realm_host}/token",'
                                    f'service="fake",scope="repository:{ns}/{model}:{action}"'})
            self._drain()
            return None
        return ns, model, kind, ref

    def _drain(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)

    def do_HEAD(self) -> None:
        route = self._route()
        if route is None:
            return
        ns, model, kind, ref = route
        if kind == "blobs":
            known = ref in self.reg.repo_blobs.get((ns, model), set())
            size = len(self.reg.blob_bytes(ref)) if known else 0
            self.send_bytes(200 if known else 404, b"", {"X-Blob-Size": str(size)})
        else:
            self.do_GET()

    def do_POST(self) -> None:
        if (route := self._route()) is not None:
            upload.start(self, *route)

    def do_PATCH(self) -> None:
        if (route := self._route()) is not None:
            upload.patch(self, route[3])

    def do_PUT(self) -> None:
        if (route := self._route()) is None:
            return
        ns, model, kind, ref = route
        if kind == "manifests":
            upload.put_manifest(self, ns, model, ref)
        else:
            upload.finish(self, ref)

    def do_GET(self) -> None:
        reg = self.reg
        if self.path.startswith("/token"):
            reg.stats.token_requests += 1
            self.send_bytes(200, json.dumps({"token": reg.token}).encode(),
                            {"Content-Type": "application/json"})
            return
        route = self._route()
        if route is None:
            return
        ns, model, kind, ref = route
        if kind == "manifests":
            raw = reg.manifests.get((ns, model, ref))
            if raw is None:
                self.send_bytes(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')
            elif reg.faults.gzip_manifest:
                bomb = gzip.compress(b" " * (64 << 20))
                self.send_bytes(200, bomb, {"Content-Encoding": "gzip",
                                            "Content-Type": mt.MANIFEST_MEDIA_TYPE})
            else:
                self.send_bytes(200, raw, {"Content-Type": mt.MANIFEST_MEDIA_TYPE})
        elif kind == "blobs":
            if reg.faults.no_redirect:
                _serve_blob(self, ref)
            else:
                self.send_bytes(reg.faults.redirect_status, b"",
                                {"Location": f"{reg.cdn_url}/blobs/{ref}"})
        else:
            self.send_bytes(404, b"")


class _CdnHandler(_Base):
    def do_GET(self) -> None:
        _serve_blob(self, self.path.rsplit("/", 1)[-1])


def _serve_blob(handler: _Base, digest: str) -> None:
    reg = handler.reg
    if digest not in reg.blobs:
        handler.send_bytes(404, b"")
        return
    data = reg.blob_bytes(digest)
    start, end = 0, len(data) - 1
    rng = handler.headers.get("Range")
    status = 200
    if rng and not reg.faults.ignore_range:
        a, _, b = rng.removeprefix("bytes=").partition("-")
        start, end = int(a), int(b) if b else len(data) - 1
        status = 206
    with reg.stats.lock:
        reg.stats.blob_requests += 1
        reg.stats.ranges.append(rng or "")
    body = data[start:end + 1]
    if reg.faults.corrupt and start == 0 and body:
        body = bytes([body[0] ^ 0xFF]) + body[1:]
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    if status == 206:
        handler.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
    handler.end_headers()
    if reg.faults.stall_once:
        delay, reg.faults.stall_once = reg.faults.stall_once, 0.0
        time.sleep(delay)
    gate = reg.faults.gates.get(digest)
    if gate is not None:
        gate.wait(60)
    pos = 0
    try:
        while pos < len(body):
            if reg.faults.hold_after and reg.stats.blob_bytes >= reg.faults.hold_after:
                reg.faults.held.set()
                reg.faults.resume.wait(60)
            piece = body[pos:pos + 65536]
            with reg.stats.lock:
                before = reg.stats.blob_bytes
                after = before + len(piece)
                cut = next((d for d in reg.faults.drop_at if before < d <= after), None)
                if cut is not None:
                    reg.faults.drop_at.remove(cut)
                    piece = piece[:cut - before]
                reg.stats.blob_bytes += len(piece)
                reg.stats.by_digest[digest] = reg.stats.by_digest.get(digest, 0) + len(piece)
            handler.wfile.write(piece)
            pos += len(piece)
            if cut is not None:
                handler.wfile.flush()
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            if reg.faults.blob_delay:
                time.sleep(reg.faults.blob_delay)
    except OSError:
        handler.close_connection = True
