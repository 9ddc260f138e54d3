"""Blob store and manifests: one digest-to-path function, atomic writes, refcounted delete."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from corral.errors import DigestMismatch, InvalidDigest, ModelNotFound
from corral.registry import manifest as mt
from corral.registry.manifest import Layer, Manifest, parse_manifest
from corral.registry.names import parse_name
from corral.registry.store import Store

TRAVERSAL = [
    "sha256:../../etc/passwd", "sha256-../x", "sha256:" + "a" * 63, "sha256:" + "a" * 65,
    "sha256:" + "A" * 64, "sha256:" + "g" * 64, "", "sha512:" + "a" * 128, "sha256:",
    "sha256-" + "a" * 64 + "/../../x", "../sha256-" + "a" * 64, "sha256:" + "a" * 64 + "\n",
]


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("digest", TRAVERSAL)
def test_bad_digests_never_become_paths(store: Store, tmp_path: Path, digest: str) -> None:
    before = files_under(tmp_path)
    for op in (store.blob_path, store.has_blob, store.delete_blob):
        with pytest.raises(InvalidDigest):
            op(digest)
    with pytest.raises(InvalidDigest):
        store.write_blob_bytes(b"x", expected=digest)
    assert files_under(tmp_path) == before


def test_both_digest_spellings_name_one_file(store: Store) -> None:
    hexd = "ab" * 32
    assert store.blob_path(f"sha256:{hexd}") == store.blob_path(f"sha256-{hexd}")
    assert store.blob_path(f"sha256:{hexd}").name == f"sha256-{hexd}"


def test_write_verifies_and_leaves_nothing_on_mismatch(store: Store) -> None:
    data = b"hello world"
    good = "sha256:" + hashlib.sha256(data).hexdigest()
    assert store.write_blob_bytes(data, good) == (good, len(data))
    assert store.blob_path(good).read_bytes() == data
    wrong = "sha256:" + "0" * 64
    with pytest.raises(DigestMismatch):
        store.write_blob([b"other ", b"bytes"], wrong)
    assert sorted(p.name for p in store.blobs.iterdir()) == [f"sha256-{good[7:]}"]


def test_error_mid_stream_removes_temp_file(store: Store) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b"partial data"
        raise OSError("connection lost")

    with pytest.raises(OSError):
        store.write_blob(chunks())
    assert list(store.blobs.iterdir()) == []


def _make_model(store: Store, name: str, payload: bytes, shared: bytes = b"shared") -> Manifest:
    model_digest, model_size = store.write_blob_bytes(payload)
    shared_digest, shared_size = store.write_blob_bytes(shared)
    config_digest, config_size = store.write_blob_bytes(json.dumps({"name": name}).encode())
    manifest = Manifest(
        Layer(mt.CONFIG_MEDIA_TYPE, config_digest, config_size),
        (Layer(mt.MODEL, model_digest, model_size), Layer(mt.LICENSE, shared_digest, shared_size)),
    )
    store.write_manifest(parse_name(name), manifest.to_bytes())
    return manifest


def test_manifest_layout_list_and_id(store: Store) -> None:
    manifest = _make_model(store, "alpha:1", b"weights-a")
    path = store.manifests / "registry.ollama.ai" / "library" / "alpha" / "1"
    assert path.read_bytes() == manifest.to_bytes()
    [entry] = store.list_models()
    assert entry.name.display() == "alpha:1"
    assert entry.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entry.size == manifest.size()


def test_lookup_is_case_insensitive(store: Store) -> None:
    _make_model(store, "Alpha:Latest", b"w")
    assert store.resolve("alpha") == parse_name("Alpha:Latest")
    assert store.read_manifest("ALPHA:latest")[1].layers


def test_copy_and_refcounted_delete(store: Store) -> None:
    a = _make_model(store, "alpha", b"weights-a")
    b = _make_model(store, "beta", b"weights-b")
    store.copy("alpha", parse_name("gamma:x"))
    assert {e.name.display() for e in store.list_models()} == {
        "alpha:latest", "beta:latest", "gamma:x"}
    store.delete("alpha")
    assert store.has_blob(a.layers[0].digest)  # still used by gamma
    store.delete("gamma:x")
    assert not store.has_blob(a.layers[0].digest)
    assert store.has_blob(b.layers[1].digest)  # shared layer still used by beta
    store.delete("beta")
    assert list(store.blobs.iterdir()) == []
    assert not any(store.manifests.rglob("*"))
    with pytest.raises(ModelNotFound):
        store.delete("beta")


def test_manifest_referencing_missing_blob_is_refused(store: Store) -> None:
    manifest = Manifest(Layer(mt.CONFIG_MEDIA_TYPE, "sha256:" + "1" * 64, 1),
                        (Layer(mt.MODEL, "sha256:" + "2" * 64, 1),))
    with pytest.raises(ModelNotFound):
        store.write_manifest(parse_name("ghost"), manifest.to_bytes())
    assert store.list_models() == []


def test_prune_removes_only_old_unreferenced_files(store: Store) -> None:
    kept = _make_model(store, "alpha", b"weights")
    orphan, _ = store.write_blob_bytes(b"orphan")
    young_orphan, _ = store.write_blob_bytes(b"young orphan")
    partial = store.blobs / ("sha256-" + "c" * 64 + "-partial")
    partial.write_bytes(b"half")
    old = 1_000_000.0
    for path in [store.blob_path(orphan), partial, *(store.blob_path(d) for d in kept.digests())]:
        os.utime(path, (old, old))
    removed = store.prune(max_age=3600, now=lambda: old + 7200)
    assert sorted(removed) == sorted([store.blob_path(orphan).name, partial.name])
    assert all(store.has_blob(d) for d in kept.digests())
    assert store.has_blob(young_orphan)


@pytest.mark.parametrize("doc", [
    b"not json", b"[]", b'{"schemaVersion":2}', b'{"schemaVersion":2,"layers":[]}',
    b'{"schemaVersion":1,"layers":[{}]}',
    json.dumps({"schemaVersion": 2, "config": {"mediaType": mt.CONFIG_MEDIA_TYPE,
               "digest": "sha256:../../x", "size": 1},
               "layers": [{"mediaType": mt.MODEL, "digest": "sha256:" + "a" * 64,
                           "size": 1}]}).encode(),
    json.dumps({"schemaVersion": 2, "config": {"mediaType": mt.CONFIG_MEDIA_TYPE,
               "digest": "sha256:" + "a" * 64, "size": 1},
               "layers": [{"mediaType": "text/html", "digest": "sha256:" + "a" * 64,
                           "size": 1}]}).encode(),
    json.dumps({"schemaVersion": 2, "config": {"mediaType": mt.CONFIG_MEDIA_TYPE,
               "digest": "sha256:" + "a" * 64, "size": -1},
               "layers": [{"mediaType": mt.MODEL, "digest": "sha256:" + "a" * 64,
                           "size": 1}]}).encode(),
    b"[" * 100000,
    b" " * (5 << 20),
])
def test_malformed_manifests(doc: bytes) -> None:
    with pytest.raises(Exception) as info:
        parse_manifest(doc)
    assert info.value.__class__.__name__ in ("BadRequest", "InvalidDigest")


def test_gguf_facts_are_read_once_per_digest(store: Store, tmp_path: Path) -> None:
    from tests.gguf_files import write_tiny_gguf

    digest, _ = store.write_blob_bytes(write_tiny_gguf(tmp_path / "t.gguf").read_bytes())
    first = store.gguf_info(digest)
    assert first.architecture == "llama"
    assert store.gguf_info(digest.replace(":", "-")) is first  # cached, whatever the spelling
