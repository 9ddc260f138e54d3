"""Registry pulls against a real loopback registry that can be made to misbehave."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import pytest

from corral.errors import BadRequest, CorralError, DigestMismatch, NoSpace, Unauthorized
from corral.registry import manifest as mt
from corral.registry.download import Downloader, DownloadOptions
from corral.registry.pull import Puller
from corral.registry.store import Store
from tests.registry_server import FakeRegistry
from tests.support import DaemonFactory, wait_for

FAST = DownloadOptions(parts=4, part_size=1 << 20, stall_timeout=2.0, retries=3, backoff=0.01)


@pytest.fixture
def reg(starter_gguf: Path) -> Iterator[FakeRegistry]:
    r = FakeRegistry()
    layers = [(mt.MODEL, starter_gguf), (mt.TEMPLATE, b"{{ .Prompt }}"),
              (mt.PARAMS, b'{"stop":["User:"]}'), (mt.LICENSE, b"Gemma terms")]
    r.add_model("library", "starter", "latest", layers)
    r.add_model("private", "starter", "latest", layers)
    yield r
    r.close()


def puller(store: Store, options: DownloadOptions = FAST) -> Puller:
    return Puller(store, Downloader(store, options))


def model_digest(reg: FakeRegistry) -> tuple[str, int]:
    doc = json.loads(reg.manifests[("library", "starter", "latest")])
    layer = doc["layers"][0]
    return layer["digest"], layer["size"]


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_clean_pull_is_byte_exact(reg: FakeRegistry, store: Store) -> None:
    events: list[dict[str, Any]] = []
    name = puller(store).pull(f"{reg.host}/library/starter", events.append, insecure=True)
    assert name.display() == f"{reg.host}/library/starter:latest"
    data, _ = store.read_manifest(name)
    assert data == reg.manifests[("library", "starter", "latest")]
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    digest, size = model_digest(reg)
    mine = [e for e in events if e.get("digest") == digest]
    assert mine[-1]["completed"] == mine[-1]["total"] == size
    assert all(e["status"] == f"pulling {digest[7:19]}" for e in mine)
    assert not [p for p in store.blobs.iterdir() if "partial" in p.name]


@pytest.mark.parametrize("status", [301, 302, 303, 308, None])
def test_any_redirect_or_none(reg: FakeRegistry, store: Store, status: int | None) -> None:
    if status is None:
        reg.faults.no_redirect = True
    else:
        reg.faults.redirect_status = status
    puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert store.list_models()


def test_resume_after_drops_fetches_only_missing_bytes(reg: FakeRegistry, store: Store) -> None:
    digest, size = model_digest(reg)
    reg.faults.drop_at = [int(size * 0.4), int(size * 0.8)]
    puller(store, DownloadOptions(parts=4, part_size=size // 4 + 1, stall_timeout=5,
                                  retries=3, backoff=0.01)).pull(
        f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert store.has_blob(digest)
    others = sum(len(reg.blob_bytes(d)) for d in reg.blobs if d != digest)
    refetched = reg.stats.blob_bytes - size - others
    assert refetched < size * 0.05, refetched  # not a restart from zero
    assert any(r and not r.startswith(f"bytes={i * (size // 4 + 1)}-")
               for i, r in enumerate(reg.stats.ranges[4:])), reg.stats.ranges


def test_server_ignoring_range_restarts_cleanly(reg: FakeRegistry, store: Store) -> None:
    reg.faults.ignore_range = True
    puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    digest, _ = model_digest(reg)
    assert store.has_blob(digest)


def test_stall_restarts_the_part(reg: FakeRegistry, store: Store) -> None:
    reg.faults.stall_once = 3.0  # longer than FAST.stall_timeout
    puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert store.list_models()


def test_wrong_digest_leaves_nothing(reg: FakeRegistry, store: Store) -> None:
    reg.faults.corrupt = True
    with pytest.raises(DigestMismatch):
        puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert store.list_models() == []
    digest, _ = model_digest(reg)
    assert not store.has_blob(digest)
    assert not [p for p in store.blobs.iterdir() if "partial" in p.name or "tmp" in p.name]


def _bad_manifest(reg: FakeRegistry, doc: Any) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    reg.manifests[("library", "bad", "latest")] = raw


@pytest.mark.parametrize("digest", ["sha256:../../x", "sha256-../../../etc/passwd",
                                    "sha256:" + "a" * 63, "../../x", "sha512:" + "a" * 128])
def test_traversal_digests_create_nothing(reg: FakeRegistry, store: Store, tmp_path: Path,
                                          digest: str) -> None:
    _bad_manifest(reg, {"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE,
                        "config": {"mediaType": mt.CONFIG_MEDIA_TYPE,
                                   "digest": "sha256:" + "b" * 64, "size": 2},
                        "layers": [{"mediaType": mt.MODEL, "digest": digest, "size": 5}]})
    before = files(tmp_path)
    with pytest.raises(BadRequest):
        puller(store).pull(f"{reg.host}/library/bad", lambda e: None, insecure=True)
    assert files(tmp_path) == before


@pytest.mark.parametrize("doc,message", [
    (b"{" + b" " * (5 << 20) + b"}", "too large"),
    (b"not json at all", "not JSON"),
    ({"schemaVersion": 2, "layers": []}, "no layers"),
    ({"schemaVersion": 2}, "no layers"),
    ({"schemaVersion": 2, "config": {"mediaType": mt.CONFIG_MEDIA_TYPE,
      "digest": "sha256:" + "b" * 64, "size": 1}, "layers": [{"mediaType": "text/html",
      "digest": "sha256:" + "a" * 64, "size": 1}]}, "media type"),
])
def test_hostile_manifests(reg: FakeRegistry, store: Store, doc: Any, message: str) -> None:
    _bad_manifest(reg, doc)
    with pytest.raises(CorralError, match=message):
        puller(store).pull(f"{reg.host}/library/bad", lambda e: None, insecure=True)
    assert store.list_models() == []


def test_gzip_bomb_is_refused(reg: FakeRegistry, store: Store) -> None:
    reg.faults.gzip_manifest = True
    with pytest.raises(CorralError, match="compressed"):
        puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)


def test_unknown_model_and_plain_http(reg: FakeRegistry, store: Store) -> None:
    with pytest.raises(CorralError, match="pull model manifest: file does not exist"):
        puller(store).pull(f"{reg.host}/library/missing", lambda e: None, insecure=True)
    with pytest.raises(BadRequest, match="insecure protocol http"):
        puller(store).pull(f"http://{reg.host}/library/starter", lambda e: None)


def test_private_namespace_token_flow(reg: FakeRegistry, store: Store) -> None:
    puller(store).pull(f"{reg.host}/private/starter", lambda e: None, insecure=True)
    assert reg.stats.token_requests == 1 and store.list_models()


def test_foreign_auth_realm_is_refused(reg: FakeRegistry, store: Store) -> None:
    reg.faults.foreign_realm = True
    with pytest.raises(Unauthorized, match="realm"):
        puller(store).pull(f"{reg.host}/private/starter", lambda e: None, insecure=True)
    assert reg.stats.token_requests == 0 and store.list_models() == []


def test_single_flight(reg: FakeRegistry, store: Store) -> None:
    digest, size = model_digest(reg)
    # The model's blob is held before its first byte until every pull waits on it: five
    # downloads of it, if pulls did not share one, would all be under way by then.
    gate = reg.faults.gates[digest] = threading.Event()
    shared = puller(store)
    logs: list[list[dict[str, Any]]] = [[] for _ in range(5)]
    results: list[Any] = []

    def one(events: list[dict[str, Any]]) -> None:
        try:
            shared.pull(f"{reg.host}/library/starter", events.append, insecure=True)
            results.append(events)
        except CorralError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(any(e.get("digest") == digest for e in list(log))
                             for log in logs), timeout=60)
    finally:
        gate.set()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(r, list) and r[-1] == {"status": "success"} for r in results)
    assert len(results) == 5
    # Sent once. A part restarted after a stall (a busy machine) asks again from its
    # last byte, so only what was in flight goes twice; a second download is all of it.
    assert size <= reg.stats.by_digest[digest] < 2 * size, (reg.stats.by_digest, size)
    assert len([p for p in store.blobs.iterdir() if p.name == f"sha256-{digest[7:]}"]) == 1


def test_pull_resumes_after_restart(reg: FakeRegistry, store: Store) -> None:
    digest, size = model_digest(reg)
    reg.faults.hold_after = size // 3  # the registry stops sending there, until resumed
    first = puller(store)
    with pytest.raises(CorralError, match="cancelled"):
        # Cancelled once the registry holds: not on a count of the model's own bytes,
        # which the other blobs sent first keep just under the third (it then never
        # fired, and the progress it waited for piled up).
        first.pull(f"{reg.host}/library/starter", lambda e: None, insecure=True,
                   cancelled=reg.faults.held.is_set)
    # The held parts go on, see the cancel and stop: the abandoned download ends (it
    # leaves `active` once its parts have), and its partial files stay.
    reg.faults.hold_after = 0
    reg.faults.resume.set()
    wait_for(lambda: digest not in first.downloader.active)
    assert [p for p in store.blobs.iterdir() if p.name.endswith("-partial")]
    assert not store.has_blob(digest)
    served_before = reg.stats.blob_bytes
    puller(Store(store.root)).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert store.has_blob(digest)
    assert reg.stats.blob_bytes - served_before < size - size // 4


def test_disk_full_fails_fast_and_daemon_keeps_serving(reg: FakeRegistry, tmp_path: Path,
                                                       daemon_factory: DaemonFactory) -> None:
    _, size = model_digest(reg)
    # A store that holds half the model: the disk is full for it, with no filesystem to
    # mount (that needs root); the store's capacity is what a full disk looks like to it.
    store = Store(tmp_path / "small", capacity=size // 2)
    start = time.monotonic()
    with pytest.raises(NoSpace, match="no space left"):
        puller(store).pull(f"{reg.host}/library/starter", lambda e: None, insecure=True)
    assert time.monotonic() - start < 30
    # Failed before fetching the model layer, and left no partial file of it.
    assert store.list_models() == [] and reg.stats.blob_bytes < size // 4
    assert not [p for p in store.blobs.iterdir() if "partial" in p.name]
    d = daemon_factory(None, root=tmp_path / "daemon", capacity=size // 2)
    r = httpx.post(d.url + "/api/pull", json={"model": f"{reg.host}/library/starter",
                                               "insecure": True}, timeout=120)
    assert "no space left" in r.text
    assert httpx.get(d.url + "/api/tags").status_code == 200


def test_a_store_upload_past_its_capacity_is_no_space(tmp_path: Path) -> None:
    store = Store(tmp_path / "models", capacity=3 << 20)
    with pytest.raises(NoSpace, match="no space left"):
        store.write_blob(iter([b"x" * (1 << 20)] * 4))
    assert not list(store.blobs.iterdir())  # the temp file went with the error
    digest, _ = store.write_blob(iter([b"x" * (1 << 20)] * 2))
    assert store.has_blob(digest) and store.free_space() <= 1 << 20
    with pytest.raises(ValueError, match="cannot be negative"):
        Store(tmp_path / "other", capacity=-1)


def test_api_pull_progress_and_clients(reg: FakeRegistry, starter_store: Store,
                                       daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NOPRUNE="1")
    name = f"{reg.host}/library/starter"
    with httpx.stream("POST", d.url + "/api/pull", json={"model": name, "insecure": True},
                      timeout=120) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in resp.iter_lines()]
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "pulling manifest"
    layer_lines = [line for line in lines if line["status"].startswith("pulling ")
                   and line["status"] != "pulling manifest"]
    assert layer_lines and all({"digest", "total", "completed"} <= set(line)
                               for line in layer_lines)
    assert statuses[len(layer_lines) + 1:] == ["verifying sha256 digest",
                                                "writing manifest", "success"]
    r = httpx.post(d.url + "/api/generate", timeout=120, json={
        "model": name, "prompt": "Hello", "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["eval_count"] == 4
    client = ollama.Client(host=d.url)
    assert client.pull(name, insecure=True).status == "success"
    parts = list(client.pull(name, insecure=True, stream=True))
    assert parts[-1].status == "success"
    with pytest.raises(ollama.ResponseError, match="file does not exist"):
        client.pull(f"{reg.host}/library/missing", insecure=True)
