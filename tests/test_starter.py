"""The starter models: streamed into the store, sha256-checked, with the right templates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from corral.registry import manifest as mt
from corral.registry.gguf import inspect_gguf
from corral.registry.models import FALLBACK_TEMPLATE
from corral.registry.starter import (BASE, CHAT, CHAT_NAME, STARTER_NAME, package_parts,
                              install_starter, starter_model_path)
from corral.registry.store import Store, file_sha256
from corral.server.daemon import Daemon


def test_both_starters_are_listed_with_their_packages_sha256(starter_store: Store) -> None:
    names = sorted(e.name.display() for e in starter_store.list_models())
    assert names == sorted([STARTER_NAME, CHAT_NAME])
    for starter in (BASE, CHAT):
        path = starter_model_path(starter_store, starter.name)
        assert path is not None
        assert file_sha256(path) == package_parts(starter)[1] == "sha256:" + path.name[7:]


def test_completion_starter_layers(starter_store: Store) -> None:
    _, manifest = starter_store.read_manifest(STARTER_NAME)
    read = starter_store.read_blob
    assert read(manifest.layers_of(mt.TEMPLATE)[0].digest).decode() == FALLBACK_TEMPLATE
    params = json.loads(read(manifest.layers_of(mt.PARAMS)[0].digest))
    assert "User:" in params["stop"]
    assert "Gemma" in read(manifest.layers_of(mt.LICENSE)[0].digest).decode()
    config = json.loads(read(manifest.config.digest))
    assert config["model_family"] == "gemma3" and config["file_type"] == "Q4_K_M"
    assert config["model_type"] == "268.10M"


def test_chat_starter_uses_the_template_in_its_gguf(starter_store: Store) -> None:
    _, manifest = starter_store.read_manifest(CHAT_NAME)
    read = starter_store.read_blob
    assert manifest.layers_of(mt.TEMPLATE) == []  # nothing hand-written: the GGUF's Jinja wins
    path = starter_model_path(starter_store, CHAT_NAME)
    assert path is not None
    template = inspect_gguf(path).chat_template
    assert template is not None and "<|im_start|>" in template
    params = json.loads(read(manifest.layers_of(mt.PARAMS)[0].digest))
    assert params == {"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.2,
                      "top_p": 0.9, "num_predict": 512}
    assert "Apache License" in read(manifest.layers_of(mt.LICENSE)[0].digest).decode()
    config = json.loads(read(manifest.config.digest))
    assert config["model_family"] == "llama" and config["file_type"] == "Q4_1"


def test_install_is_idempotent(starter_store: Store) -> None:
    before = {n: starter_store.entry(n).digest for n in (STARTER_NAME, CHAT_NAME)}
    blobs = sorted(p.name for p in starter_store.blobs.iterdir())
    install_starter(starter_store, BASE)
    install_starter(starter_store, CHAT)
    assert {n: starter_store.entry(n).digest for n in before} == before
    assert sorted(p.name for p in starter_store.blobs.iterdir()) == blobs


def parameter_lines(text: str) -> dict[str, list[str]]:
    """`show --parameters` text (`name value` a line) as each name's values, in order."""
    out: dict[str, list[str]] = {}
    for line in text.strip().splitlines():
        key, value = line.split(None, 1)
        out.setdefault(key, []).append(value.strip())
    return out


def test_chat_starter_shows_its_model_cards_sampling(daemon: Daemon) -> None:
    # What SmolLM2's model card recommends, as Ollama's library models carry theirs, and
    # a cap so that a cold `corral run smollm2:135m hi` always ends.
    want = {"stop": ['"<|im_start|>"', '"<|im_end|>"'], "temperature": ["0.2"],
            "top_p": ["0.9"], "num_predict": ["512"]}
    shown = httpx.post(daemon.url + "/api/show", json={"model": CHAT_NAME}, timeout=30)
    assert parameter_lines(shown.json()["parameters"]) == want
    host, port = daemon.address
    cli = subprocess.run([sys.executable, "-c", "from corral.cli.launch import main; main()",
                          "show", CHAT_NAME, "--parameters"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, CORRAL_HOST=f"{host}:{port}"))
    assert cli.returncode == 0, cli.stderr
    assert parameter_lines(cli.stdout) == want
