"""Pushes to the loopback registry: the upload protocol, skips and mounts, retries of a
blob cut off mid-upload, bearer challenges, and the route, clients and CLI on top."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import pytest

from corral.errors import Unauthorized
from corral.registry import manifest as mt
from corral.registry.download import Downloader, DownloadOptions
from corral.registry.manifest import Layer, Manifest
from corral.registry.names import parse_name
from corral.registry.pull import Puller
from corral.registry.push import NOT_YOURS, Pusher, PushOptions
from corral.registry.store import Store
from tests.registry_server import FakeRegistry
from tests.support import DaemonFactory

SMALL = PushOptions(chunk_size=100_000, piece=16_384, retries=2, backoff=0.01)
CORRAL = [sys.executable, "-c", "from corral.cli.launch import main; main()"]


@pytest.fixture
def reg() -> Iterator[FakeRegistry]:
    r = FakeRegistry()
    yield r
    r.close()


def put_model(store: Store, name: str, seed: int = 0) -> bytes:
    """A model of random layers (push never parses them), written as a pull would."""
    rng = __import__("random").Random(seed)
    weights = bytes(rng.getrandbits(8) for _ in range(350_000))
    layers = []
    for media, data in ((mt.MODEL, weights), (mt.TEMPLATE, b"{{ .Prompt }}"),
                        (mt.PARAMS, b'{"temperature":0}')):
        digest, size = store.write_blob_bytes(data)
        layers.append(Layer(media, digest, size))
    cdigest, csize = store.write_blob_bytes(b'{"model_format":"gguf"}')
    raw = Manifest(Layer(mt.CONFIG_MEDIA_TYPE, cdigest, csize), tuple(layers)).to_bytes()
    store.write_manifest(parse_name(name), raw)
    return raw


def push(store: Store, name: str, options: PushOptions = SMALL) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    Pusher(store, options).push(name, events.append, insecure=True)
    return events


def pulled_copy(reg: FakeRegistry, name: str, root: Path) -> Store:
    fresh = Store(root)
    Puller(fresh, Downloader(fresh, DownloadOptions(part_size=1 << 20))).pull(
        name, lambda e: None, insecure=True)
    return fresh


def same_model(a: Store, b: Store, name: str) -> None:
    raw_a, manifest = a.read_manifest(name)
    assert b.read_manifest(name)[0] == raw_a  # byte-exact: the same model ID
    for digest in manifest.digests():
        assert b.blob_path(digest).read_bytes() == a.blob_path(digest).read_bytes()


def test_push_then_pull_is_byte_identical(reg: FakeRegistry, store: Store,
                                          tmp_path: Path) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    events = push(store, name)
    statuses = [e["status"] for e in events]
    assert statuses[0] == "retrieving manifest" and statuses[-2:] == ["pushing manifest",
                                                                      "success"]
    layer_events = [e for e in events if "digest" in e]
    assert all({"total", "completed"} <= set(e) for e in layer_events)
    weights = max(layer_events, key=lambda e: e["total"])
    partial = [e["completed"] for e in layer_events if e["digest"] == weights["digest"]]
    assert len(set(partial)) > 5 and partial == sorted(partial)  # progress as bytes go out
    assert reg.stats.uploads == 4 and reg.stats.mounts == 0
    same_model(store, pulled_copy(reg, name, tmp_path / "fresh"), name)


def test_a_draft_layer_travels_with_its_model(reg: FakeRegistry, store: Store,
                                              tmp_path: Path) -> None:
    from corral.registry.models import load_record

    name = f"{reg.host}/alice/drafted:v1"
    put_model(store, name)
    raw, base = store.read_manifest(name)
    digest, size = store.write_blob_bytes(b"draft weights")
    drafted = Manifest(base.config, (*base.layers, Layer(mt.DRAFT, digest, size, "small:1b")))
    store.write_manifest(parse_name(name), drafted.to_bytes())
    push(store, name)
    fresh = pulled_copy(reg, name, tmp_path / "fresh")
    same_model(store, fresh, name)
    record = load_record(fresh, name)
    assert record.draft_digest == digest and record.draft_from == "small:1b"
    assert record.draft is not None and record.draft.read_bytes() == b"draft weights"


@pytest.mark.model
def test_a_pulled_draft_gets_the_vocabulary_check(reg: FakeRegistry, chat_gguf: Path,
                                                  starter_gguf: Path, tmp_path: Path) -> None:
    """As at create: a pulled DRAFT whose vocabulary is not the model's fails the pull,
    naming the difference, and nothing is written; a matching one is pulled."""
    from benchmarks.gpu_model import cut_tokenizer
    from corral.errors import ModelfileError

    chat, gemma = tmp_path / "chat.gguf", tmp_path / "gemma.gguf"
    cut_tokenizer(chat_gguf, chat)  # vocabularies only: a few MB each
    cut_tokenizer(starter_gguf, gemma)
    reg.add_model("alice", "mismatched", "v1", [(mt.MODEL, chat), (mt.DRAFT, gemma)])
    reg.add_model("alice", "matched", "v1", [(mt.MODEL, chat), (mt.DRAFT, chat)])
    with pytest.raises(ModelfileError, match="vocabulary is not the model's.*tokenizer"):
        pulled_copy(reg, f"{reg.host}/alice/mismatched:v1", tmp_path / "a")
    assert Store(tmp_path / "a").resolve(parse_name(f"{reg.host}/alice/mismatched:v1")) is None
    fresh = pulled_copy(reg, f"{reg.host}/alice/matched:v1", tmp_path / "b")
    assert fresh.resolve(parse_name(f"{reg.host}/alice/matched:v1")) is not None


def test_second_push_uploads_nothing(reg: FakeRegistry, store: Store) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    push(store, name)
    sent, sessions = reg.stats.upload_bytes, reg.stats.uploads
    events = push(store, name)
    assert (reg.stats.upload_bytes, reg.stats.uploads) == (sent, sessions)
    assert all(e["completed"] == e["total"] for e in events if "digest" in e)


def test_blobs_another_repository_holds_are_mounted(reg: FakeRegistry, store: Store) -> None:
    first = f"{reg.host}/alice/tiny:v1"
    put_model(store, first)
    push(store, first)
    sent = reg.stats.upload_bytes
    second = parse_name(f"{reg.host}/bob/tiny:v1")
    store.copy(first, second)
    push(store, second.full())
    assert reg.stats.upload_bytes == sent and reg.stats.mounts == 4
    assert reg.manifests[("bob", "tiny", "v1")] == store.read_manifest(second)[0]


def test_a_blob_cut_off_mid_upload_is_retried(reg: FakeRegistry, store: Store,
                                              tmp_path: Path) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    reg.faults.drop_upload_at = [150_000, 420_000]
    push(store, name)
    assert reg.faults.drop_upload_at == [] and reg.stats.uploads == 6  # two fresh sessions
    same_model(store, pulled_copy(reg, name, tmp_path / "fresh"), name)


def test_a_registry_that_keeps_failing_fails_the_push(reg: FakeRegistry, store: Store) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    reg.faults.drop_upload_at = [50_000, 150_000, 250_000, 350_000]
    with pytest.raises(Exception):
        push(store, name)
    assert ("alice", "tiny", "v1") not in reg.manifests  # the manifest only goes last


def test_private_namespace_gets_a_push_token(reg: FakeRegistry, store: Store) -> None:
    name = f"{reg.host}/private/tiny:v1"
    put_model(store, name)
    push(store, name)
    assert reg.stats.token_requests >= 1 and ("private", "tiny", "v1") in reg.manifests


def test_foreign_token_realm_is_refused(reg: FakeRegistry, store: Store) -> None:
    name = f"{reg.host}/private/tiny:v1"
    put_model(store, name)
    reg.faults.foreign_realm = True
    with pytest.raises(Unauthorized, match="not the registry host"):
        push(store, name)
    assert reg.stats.upload_bytes == 0


def test_library_namespace_is_refused_before_any_upload(store: Store) -> None:
    put_model(store, "tiny:latest")
    with pytest.raises(Unauthorized) as err:
        push(store, "tiny")
    assert err.value.message == NOT_YOURS


def test_api_push_streams_and_clients_push(reg: FakeRegistry, store: Store,
                                           daemon_factory: DaemonFactory,
                                           tmp_path: Path) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    d = daemon_factory(store)
    with httpx.stream("POST", d.url + "/api/push", json={"model": name, "insecure": True},
                      timeout=60) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in resp.iter_lines()]
    assert lines[0]["status"] == "retrieving manifest" and lines[-1]["status"] == "success"
    client = ollama.Client(host=d.url)
    assert client.push(name, insecure=True).status == "success"
    assert list(client.push(name, insecure=True, stream=True))[-1].status == "success"
    missing = httpx.post(d.url + "/api/push", json={"model": f"{reg.host}/alice/nope"})
    assert missing.status_code == 404 and "error" in missing.json()
    refused = httpx.post(d.url + "/api/push", json={"model": "tiny"})
    assert refused.status_code in (401, 404)
    same_model(store, pulled_copy(reg, name, tmp_path / "fresh"), name)


def test_cli_push(reg: FakeRegistry, store: Store, daemon_factory: DaemonFactory) -> None:
    name = f"{reg.host}/alice/tiny:v1"
    put_model(store, name)
    put_model(store, "mine:latest", seed=1)
    d = daemon_factory(store)
    host, port = d.address
    env = dict(os.environ, CORRAL_HOST=f"{host}:{port}")
    ok = subprocess.run([*CORRAL, "push", name, "--insecure"], env=env, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.splitlines()[-1] == "success"
    assert ("alice", "tiny", "v1") in reg.manifests
    refused = subprocess.run([*CORRAL, "push", "mine"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip() == f"Error: {NOT_YOURS}"
