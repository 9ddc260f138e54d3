"""Pulling models from an Ollama-style registry (registry.ollama.ai, hf.co, private ones).

Everything the registry sends is distrusted: the manifest's size, digests,
media types and layer count are checked before anything becomes a path;
compressed responses are refused; the bearer token is only requested from a
realm on the registry's own host; blob redirects may go anywhere, but the
token never follows them. The manifest is written last, byte-exact.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, Iterator, Union
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from corral.errors import BadRequest, CorralError, InvalidModelFile, Unauthorized
from corral.registry import manifest as mt
from corral.registry.download import Download, Downloader, wait
from corral.registry.draft import check_draft
from corral.registry.manifest import (MANIFEST_MEDIA_TYPE, MAX_MANIFEST_BYTES, Manifest,
                                      parse_manifest)
from corral.registry.names import Name, parse_name
from corral.registry.progress import Progress
from corral.registry.store import Store

log = logging.getLogger("corral.pull")

ACCEPT = f"{MANIFEST_MEDIA_TYPE}, application/vnd.oci.image.manifest.v1+json"
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
Body = Union[bytes, Callable[[], Iterator[bytes]]]


class PullError(CorralError):
    pass


class Registry:
    """One registry host, with its bearer token once one has been granted."""

    def __init__(self, name: Name, insecure: bool, client: httpx.Client) -> None:
        if name.scheme == "http" and not insecure:
            raise BadRequest("insecure protocol http")
        self.scheme = "http" if insecure or name.scheme == "http" else "https"
        self.base = f"{self.scheme}://{name.host}"
        self.host = name.host
        self.client = client
        self.token: str | None = None

    def url(self, name: Name, kind: str, ref: str) -> str:
        return f"{self.base}/v2/{name.namespace}/{name.model}/{kind}/{ref}"

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        headers = {"Accept-Encoding": "identity", **extra}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                stream: bool = False, body: Body | None = None) -> httpx.Response:
        """A request that answers one bearer challenge; redirects are left to the caller.

        `body` is bytes or a function that makes the body anew, since a challenged
        request is sent twice.
        """
        for attempt in range(2):
            content = body() if callable(body) else body
            req = self.client.build_request(method, url, headers=self._headers(headers or {}),
                                            content=content)
            resp = self.client.send(req, stream=stream, follow_redirects=False)
            if resp.status_code != 401 or attempt == 1:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            resp.close()
            self._authenticate(challenge)
        raise Unauthorized("unauthorized: access denied")

    def _authenticate(self, challenge: str) -> None:
        if not challenge.lower().startswith("bearer"):
            raise Unauthorized("unauthorized: access denied")
        params = dict(_CHALLENGE.findall(challenge))
        realm = params.get("realm", "")
        realm_host = urlsplit(realm).netloc
        if not realm or realm_host.lower() != self.host.lower():
            # A token for this registry must never be requested from, or sent to, another host.
            raise Unauthorized(f"unauthorized: auth realm {realm_host or '?'} is not the "
                               f"registry host {self.host}")
        query = {"service": params.get("service", ""), "ts": str(int(time.time()))}
        scopes = params.get("scope", "").split()
        url = realm + ("&" if "?" in realm else "?") + urlencode(
            [*query.items(), *(("scope", s) for s in scopes)])
        resp = self.client.get(url, headers={"Accept-Encoding": "identity"},
                               follow_redirects=False)
        if resp.status_code != 200:
            raise Unauthorized("unauthorized: access denied")
        try:
            token = resp.json().get("token") or resp.json().get("access_token")
        except ValueError:
            token = None
        if not isinstance(token, str) or not token:
            raise Unauthorized("unauthorized: access denied")
        self.token = token


def _read_capped(resp: httpx.Response, limit: int) -> bytes:
    if resp.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise PullError("the registry sent a compressed response; refusing it")
    length = resp.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise PullError("manifest is too large")
    data = b""
    for chunk in resp.iter_raw(65536):
        data += chunk
        if len(data) > limit:
            raise PullError("manifest is too large")
    return data


class Puller:
    def __init__(self, store: Store, downloader: Downloader,
                 client_factory: Callable[[], httpx.Client] | None = None) -> None:
        self.store = store
        self.downloader = downloader
        self.client_factory = client_factory or (lambda: httpx.Client(
            timeout=httpx.Timeout(30.0), trust_env=True,
            headers={"User-Agent": "corral (ollama-compatible)"}))

    def pull(self, model: str, progress: Progress, insecure: bool = False,
             cancelled: Callable[[], bool] = lambda: False) -> Name:
        name = parse_name(model)
        with self.client_factory() as client:
            registry = Registry(name, insecure, client)
            progress({"status": "pulling manifest"})
            data = self._manifest(registry, name)
            manifest = parse_manifest(data)
            layers = [*manifest.layers, manifest.config]
            for layer in layers:
                self._layer(registry, name, layer.digest, layer.size, progress, cancelled)
            progress({"status": "verifying sha256 digest"})
            self._check_draft(manifest)
            progress({"status": "writing manifest"})
            existing = self.store.resolve(name)
            self.store.write_manifest(existing or name, data)
            progress({"status": "success"})
            return existing or name

    def _check_draft(self, manifest: Manifest) -> None:
        """A pulled DRAFT layer gets create's vocabulary check (registry/draft.py): a
        mismatch fails the pull, before its manifest is written. Where the model's layer is
        no GGUF there is no vocabulary to hold it to (and the model will not load)."""
        drafts = [ly for ly in manifest.layers if ly.media_type == mt.DRAFT]
        models = [ly for ly in manifest.layers if ly.media_type == mt.MODEL]
        if not drafts or not models:
            return
        try:
            self.store.gguf_info(models[0].digest)
        except InvalidModelFile:
            return
        check_draft(self.store, models[0].digest, drafts[0].digest)

    def _manifest(self, registry: Registry, name: Name) -> bytes:
        try:
            resp = registry.request("GET", registry.url(name, "manifests", name.tag),
                                    {"Accept": ACCEPT}, stream=True)
        except httpx.HTTPError as exc:
            raise PullError(f"pull model manifest: {exc}") from None
        try:
            if resp.status_code == 404:
                raise PullError("pull model manifest: file does not exist")
            if resp.status_code >= 300:
                body = resp.read()[:200].decode("utf-8", "replace")
                raise PullError(f"pull model manifest: {resp.status_code}: {body}")
            return _read_capped(resp, MAX_MANIFEST_BYTES)
        finally:
            resp.close()

    def _direct_url(self, registry: Registry, name: Name, digest: str) -> str:
        """Follow the blob URL's redirect (any 3xx) once; a 200 means the URL itself."""
        url = registry.url(name, "blobs", digest)
        for _ in range(5):
            resp = registry.request("GET", url, stream=True)
            resp.close()
            if resp.status_code in (301, 302, 303, 307, 308) and resp.headers.get("location"):
                url = urljoin(url, resp.headers["location"])
                if urlsplit(url).netloc != registry.host:
                    return url  # a CDN: it gets no Authorization header
                continue
            if resp.status_code in (200, 206):
                return url
            raise PullError(f"blob {digest}: unexpected status {resp.status_code}")
        raise PullError(f"blob {digest}: too many redirects")

    def _layer(self, registry: Registry, name: Name, digest: str, size: int,
               progress: Progress, cancelled: Callable[[], bool]) -> None:
        status = f"pulling {digest[7:19]}"
        if self.store.has_blob(digest):
            progress({"status": status, "digest": digest, "total": size, "completed": size})
            return
        url = self._direct_url(registry, name, digest)
        same_host = urlsplit(url).netloc == registry.host
        headers = {"Authorization": f"Bearer {registry.token}"} if same_host and registry.token \
            else {}
        dl = self.downloader.join(digest, size, url, headers)
        last = [-1.0]

        def report(d: Download) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or d.done.is_set():
                last[0] = now
                progress({"status": status, "digest": digest, "total": size,
                          "completed": min(d.completed, size)})
        try:
            wait(dl, report, cancelled=cancelled)
        finally:
            self.downloader.leave(dl)
