"""Pushing models to an Ollama-style registry with Docker distribution's upload protocol.

Each blob (the layers, then the config) is looked for with HEAD first and skipped when
the repository has it; otherwise a mount from another repository on the same registry
that holds it is tried, and only then are the bytes sent: an upload session (POST),
PATCHes of at most `chunk_size`, and a PUT with `?digest=` that commits it. The
manifest goes last, byte-exact, so its digest (the model's ID) is the same there.
The bearer token follows the same rules as in pulls: one challenge per request, a realm
only on the registry's own host, and never sent to another host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from corral.errors import BadRequest, Cancelled, CorralError, Unauthorized
from corral.registry.manifest import MANIFEST_MEDIA_TYPE, Layer, parse_manifest
from corral.registry.names import DEFAULT_HOST, DEFAULT_NAMESPACE, Name, parse_name
from corral.registry.progress import Progress
from corral.registry.pull import Body, Registry
from corral.registry.store import Store

log = logging.getLogger("corral.push")

NOT_YOURS = ("you are not authorized to push to this namespace, "
             "create the model under a namespace you own")


class PushError(CorralError):
    pass


@dataclass(frozen=True)
class PushOptions:
    chunk_size: int = 64 << 20  # bytes per PATCH
    piece: int = 1 << 20  # bytes between progress reports
    retries: int = 3  # fresh upload sessions per blob after a failure
    backoff: float = 1.0


class Pusher:
    def __init__(self, store: Store, options: PushOptions = PushOptions(),
                 client_factory: Callable[[], httpx.Client] | None = None) -> None:
        self.store = store
        self.options = options
        self.client_factory = client_factory or (lambda: httpx.Client(
            timeout=httpx.Timeout(30.0, write=300.0), trust_env=True,
            headers={"User-Agent": "corral (ollama-compatible)"}))

    def push(self, model: str, progress: Progress, insecure: bool = False,
             cancelled: Callable[[], bool] = lambda: False) -> Name:
        name = parse_name(model)
        if name.host.lower() == DEFAULT_HOST and name.namespace.lower() == DEFAULT_NAMESPACE:
            # The public registry refuses pushes to `library`; say why before any upload.
            raise Unauthorized(NOT_YOURS)
        progress({"status": "retrieving manifest"})
        raw, manifest = self.store.read_manifest(name)
        parse_manifest(raw)  # never send a manifest we would not accept
        with self.client_factory() as client:
            registry = Registry(name, insecure, client)
            try:
                for layer in [*manifest.layers, manifest.config]:
                    self._blob(registry, name, layer, progress, cancelled)
                progress({"status": "pushing manifest"})
                resp = registry.request("PUT", registry.url(name, "manifests", name.tag),
                                        {"Content-Type": MANIFEST_MEDIA_TYPE}, body=raw)
                _check(resp, "push manifest")
            except httpx.HTTPError as exc:
                raise PushError(f"push {name.display()}: {exc}") from None
        progress({"status": "success"})
        return name

    def _blob(self, registry: Registry, name: Name, layer: Layer, progress: Progress,
              cancelled: Callable[[], bool]) -> None:
        status = f"pushing {layer.digest[7:19]}"
        done = {"status": status, "digest": layer.digest, "total": layer.size,
                "completed": layer.size}
        resp = registry.request("HEAD", registry.url(name, "blobs", layer.digest))
        if resp.status_code == 200:
            progress(done)
            return
        for attempt in range(self.options.retries + 1):
            try:
                location = self._start(registry, name, layer.digest)
                if location is not None:
                    self._upload(registry, location, layer, status, progress, cancelled)
                progress(done)
                return
            except (httpx.TransportError, PushError) as exc:
                if attempt == self.options.retries:
                    raise
                log.info("%s: %s; retrying the blob", status, exc)
                time.sleep(self.options.backoff * 2 ** attempt)

    def _start(self, registry: Registry, name: Name, digest: str) -> str | None:
        """Open an upload session; None when the registry mounted the blob instead."""
        query = {"mount": digest}
        source = self._mount_source(name, digest)
        if source:
            query["from"] = source
        url = f"{registry.base}/v2/{name.namespace}/{name.model}/blobs/uploads/?" \
              + urlencode(query)
        resp = registry.request("POST", url)
        if resp.status_code == 201:
            return None
        _check(resp, f"upload {digest[7:19]}")
        location = resp.headers.get("docker-upload-location") or resp.headers.get("location")
        if not location:
            raise PushError(f"upload {digest[7:19]}: the registry gave no upload location")
        return urljoin(url, location)

    def _mount_source(self, name: Name, digest: str) -> str | None:
        """Another repository on this registry that a local model says holds `digest`."""
        for entry in self.store.list_models():
            other = entry.name
            if other.host.lower() != name.host.lower() or \
                    (other.namespace, other.model) == (name.namespace, name.model):
                continue
            try:
                if digest in self.store.read_manifest(other)[1].digests():
                    return f"{other.namespace}/{other.model}"
            except CorralError:
                continue
        return None

    def _upload(self, registry: Registry, location: str, layer: Layer, status: str,
                progress: Progress, cancelled: Callable[[], bool]) -> None:
        path = self.store.blob_path(layer.digest)
        offset = 0
        while offset < layer.size:
            size = min(self.options.chunk_size, layer.size - offset)
            body = self._chunk(path, offset, size, layer, status, progress, cancelled)
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Length": str(size),
                       "Content-Range": f"{offset}-{offset + size - 1}"}
            resp = self._send(registry, "PATCH", location, headers, body)
            _check(resp, status)
            location = urljoin(location, resp.headers.get("location") or location)
            offset += size
        sep = "&" if "?" in location else "?"
        resp = self._send(registry, "PUT", f"{location}{sep}digest={layer.digest}",
                          {"Content-Length": "0"}, b"")
        _check(resp, status)

    @staticmethod
    def _send(registry: Registry, method: str, url: str, headers: dict[str, str],
              body: Body) -> httpx.Response:
        if urlsplit(url).netloc == registry.host:
            return registry.request(method, url, headers, body=body)
        # An upload location on another host (a storage service) gets no token.
        content = body() if callable(body) else body
        return registry.client.request(method, url, headers=headers, content=content)

    def _chunk(self, path: Path, offset: int, size: int, layer: Layer, status: str,
               progress: Progress, cancelled: Callable[[], bool]) -> Callable[[], Iterator[bytes]]:
        piece = self.options.piece

        def read() -> Iterator[bytes]:
            with path.open("rb") as f:
                f.seek(offset)
                sent = 0
                while sent < size:
                    if cancelled():
                        raise Cancelled("push cancelled")
                    data = f.read(min(piece, size - sent))
                    if not data:
                        raise PushError(f"{status}: the blob is shorter than its manifest says")
                    sent += len(data)
                    yield data
                    progress({"status": status, "digest": layer.digest, "total": layer.size,
                              "completed": offset + sent})
        return read


def _check(resp: httpx.Response, what: str) -> None:
    if resp.status_code < 300:
        return
    body = resp.read()[:200].decode("utf-8", "replace")
    if resp.status_code in (401, 403):
        raise Unauthorized(NOT_YOURS)
    if resp.status_code >= 500:
        raise PushError(f"{what}: {resp.status_code}: {body}")
    raise BadRequest(f"{what}: {resp.status_code}: {body}")
