"""The upload half of the loopback registry (Docker distribution's protocol, as Ollama's
push uses it): sessions opened by POST, or a 201 when `mount` + `from` name a blob the
`from` repository holds; PATCH appends; PUT ?digest= verifies and commits; a manifest
is refused while any blob it names is missing from its repository."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from tests.registry_server import _RegistryHandler


def _query(handler: "_RegistryHandler") -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(handler.path).query).items()}


def _error(handler: "_RegistryHandler", status: int, code: str) -> None:
    handler.send_bytes(status, json.dumps({"errors": [{"code": code}]}).encode())


def start(handler: "_RegistryHandler", ns: str, model: str, kind: str, ref: str) -> None:
    reg = handler.reg
    handler._drain()
    if kind != "uploads":
        _error(handler, 405, "UNSUPPORTED")
        return
    query = _query(handler)
    mount, source = query.get("mount"), query.get("from", "")
    if mount and "/" in source:
        src = tuple(source.split("/", 1))
        if mount in reg.repo_blobs.get((src[0], src[1]), set()):
            reg.repo_blobs.setdefault((ns, model), set()).add(mount)
            with reg.stats.lock:
                reg.stats.mounts += 1
            handler.send_bytes(201, b"", {"Location": f"/v2/{ns}/{model}/blobs/{mount}"})
            return
    session = uuid.uuid4().hex
    reg.sessions[session] = ((ns, model), bytearray())
    with reg.stats.lock:
        reg.stats.uploads += 1
    handler.send_bytes(202, b"", {"Location": f"/v2/{ns}/{model}/blobs/uploads/{session}",
                                  "Docker-Upload-UUID": session, "Range": "0-0"})


def _read_body(handler: "_RegistryHandler", into: bytearray, blob: bool = True) -> bool:
    """Append the request body; False when a fault dropped the connection part-way.

    Blob bytes are counted in `stats.upload_bytes`, where the drop faults apply."""
    reg = handler.reg
    remaining = int(handler.headers.get("Content-Length") or 0)
    while remaining:
        piece = handler.rfile.read(min(remaining, 65536))
        if not piece:
            return False
        remaining -= len(piece)
        into += piece
        if not blob:
            continue
        with reg.stats.lock:
            before = reg.stats.upload_bytes
            reg.stats.upload_bytes += len(piece)
            cut = next((d for d in reg.faults.drop_upload_at
                        if before < d <= reg.stats.upload_bytes), None)
            if cut is not None:
                reg.faults.drop_upload_at.remove(cut)
        if cut is not None:
            handler.close_connection = True
            handler.connection.shutdown(2)
            return False
    return True


def _append(handler: "_RegistryHandler", session: str
            ) -> tuple[tuple[str, str], bytearray] | None:
    """The session's repository and bytes with this request's body added, or None when
    the session is unknown (answered) or the connection dropped part-way."""
    found = handler.reg.sessions.get(session)
    if found is None:
        _error(handler, 404, "BLOB_UPLOAD_UNKNOWN")
        return None
    return found if _read_body(handler, found[1]) else None


def patch(handler: "_RegistryHandler", session: str) -> None:
    found = _append(handler, session)
    if found is None:
        return
    (ns, model), data = found
    handler.send_bytes(202, b"", {"Location": f"/v2/{ns}/{model}/blobs/uploads/{session}",
                                  "Range": f"0-{max(len(data) - 1, 0)}"})


def finish(handler: "_RegistryHandler", session: str) -> None:
    reg = handler.reg
    found = _append(handler, session)
    if found is None:
        return
    (ns, model), data = found
    digest = _query(handler).get("digest", "")
    if digest != "sha256:" + hashlib.sha256(data).hexdigest():
        _error(handler, 400, "DIGEST_INVALID")
        return
    del reg.sessions[session]
    reg.blobs[digest] = bytes(data)
    reg.repo_blobs.setdefault((ns, model), set()).add(digest)
    handler.send_bytes(201, b"", {"Location": f"/v2/{ns}/{model}/blobs/{digest}",
                                  "Docker-Content-Digest": digest})


def put_manifest(handler: "_RegistryHandler", ns: str, model: str, tag: str) -> None:
    reg = handler.reg
    data = bytearray()
    if not _read_body(handler, data, blob=False):
        return
    try:
        doc = json.loads(data)
        digests = [doc["config"]["digest"], *(layer["digest"] for layer in doc["layers"])]
    except (ValueError, KeyError, TypeError):
        _error(handler, 400, "MANIFEST_INVALID")
        return
    if any(d not in reg.repo_blobs.get((ns, model), set()) for d in digests):
        _error(handler, 400, "BLOB_UNKNOWN")
        return
    reg.manifests[(ns, model, tag)] = bytes(data)
    handler.send_bytes(201, b"", {"Docker-Content-Digest":
                                  "sha256:" + hashlib.sha256(data).hexdigest()})
