"""A stored model, read back from its manifest: what show, the scheduler and the CLI need."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import CorralError
from corral.registry import manifest as mt
from corral.registry.gguf import GGUFInfo
from corral.registry.names import Name
from corral.registry.store import ModelEntry, Store

# The plain completion-style template of a model that has neither a TEMPLATE
# layer nor a chat template in its GGUF.
# A reply is rendered exactly as it was generated (the model's first token
# carries its own leading space), so the next turn's prompt starts with the
# very tokens the slot already holds, and only the new turn is prefilled.
FALLBACK_TEMPLATE = """{{- if .System }}{{ .System }}

{{ end }}
{{- range .Messages }}
{{- if eq .Role "user" }}User: {{ .Content }}
{{ else if eq .Role "assistant" }}Assistant:{{ .Content }}
{{ end }}
{{- end }}Assistant:"""


@dataclass
class ModelRecord:
    name: Name
    digest: str  # manifest sha256 hex (the model ID)
    size: int
    modified_at: float
    model_path: Path
    model_digest: str
    config: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)
    projector: Path | None = None  # a vision projector GGUF (mmproj)
    projector_digest: str | None = None
    adapters: list[Path] = field(default_factory=list)  # LoRA GGUFs, applied at scale 1
    draft: Path | None = None  # a draft model's GGUF (registry/draft.py)
    draft_digest: str | None = None
    draft_from: str | None = None  # the stored model it was taken from, if it was

    def details(self, info: GGUFInfo | None = None) -> dict[str, Any]:
        return details(self.config, info)


def details(config: dict[str, Any], info: GGUFInfo | None = None) -> dict[str, Any]:
    """Ollama's `details` object, from a manifest's config blob and the weights' header."""
    family = config.get("model_family", "")
    out: dict[str, Any] = {
        "parent_model": "",
        "format": config.get("model_format", "gguf"),
        "family": family,
        "families": config.get("model_families") or ([family] if family else None),
        "parameter_size": config.get("model_type", ""),
        "quantization_level": config.get("file_type", ""),
    }
    if info is not None:
        if info.context_length:
            out["context_length"] = info.context_length
        if info.embedding_length:
            out["embedding_length"] = info.embedding_length
    return out


def read_config(store: Store, entry: ModelEntry) -> dict[str, Any]:
    try:
        config = json.loads(store.read_blob(entry.manifest.config.digest))
    except (ValueError, CorralError):
        return {}
    return config if isinstance(config, dict) else {}


def _text(store: Store, digest: str) -> str:
    return store.read_blob(digest).decode("utf-8", errors="replace")


def load_record(store: Store, name: Name | str) -> ModelRecord:
    entry = store.entry(name)
    manifest = entry.manifest
    models = manifest.layers_of(mt.MODEL)
    if not models:
        raise CorralError(f"model '{entry.name.display()}' has no weights layer")
    record = ModelRecord(
        name=entry.name, digest=entry.digest, size=entry.size, modified_at=entry.modified_at,
        model_path=store.blob_path(models[0].digest), model_digest=models[0].digest)
    record.config = read_config(store, entry)
    for layer in manifest.layers:
        kind = layer.media_type
        if kind in (mt.TEMPLATE, mt.PROMPT):
            record.template = _text(store, layer.digest)
        elif kind == mt.SYSTEM:
            record.system = _text(store, layer.digest)
        elif kind == mt.PARAMS:
            params = json.loads(store.read_blob(layer.digest))
            if isinstance(params, dict):
                record.parameters = params
        elif kind == mt.MESSAGES:
            messages = json.loads(store.read_blob(layer.digest))
            if isinstance(messages, list):
                record.messages = messages
        elif kind == mt.LICENSE:
            record.licenses.append(_text(store, layer.digest))
        elif kind == mt.PROJECTOR:
            record.projector = store.blob_path(layer.digest)
            record.projector_digest = layer.digest
        elif kind == mt.ADAPTER:
            record.adapters.append(store.blob_path(layer.digest))
        elif kind == mt.DRAFT:
            record.draft, record.draft_digest = store.blob_path(layer.digest), layer.digest
            record.draft_from = layer.source
    return record


RECORDS_CACHED = 64


class Records:
    """Model records by stored name, built again only when the manifest's bytes change.

    Every inference request needs its model's record; building it read the config
    and text layers each time and, through pathlib, interned a set of path strings
    that died with the request: the interpreter's table of interned strings filled
    with their tombstones until it doubled (by a megabyte) mid-soak. A record is a
    function of the manifest's bytes alone (blobs never change in place), so one
    small read tells whether the cached record still holds. A cached record is
    shared between requests: nothing may modify it.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cached: OrderedDict[str, tuple[Path, bytes, ModelRecord]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: Name) -> ModelRecord:
        """The record of a stored name (as `Store.resolve` spells it)."""
        path = self.store.manifest_file(name)
        try:
            data = path.read_bytes()
        except OSError:
            return load_record(self.store, name)  # says what is missing
        key = name.display()
        with self._lock:
            hit = self._cached.get(key)
            if hit is not None and hit[1] == data:
                self._cached.move_to_end(key)
                return hit[2]
        # Replaced between the two reads? Then the next request sees other bytes.
        record = load_record(self.store, name)
        with self._lock:
            # The path is kept too: its interned parts then stay alive between requests.
            self._cached[key] = (path, data, record)
            while len(self._cached) > RECORDS_CACHED:
                self._cached.popitem(last=False)
        return record
