"""Create models: the JSON create form (files given by digest) and Modelfiles.

Layers are written first, the manifest last, so a failed create never leaves a
model that lists but does not load.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from corral.errors import InvalidModelFile, ModelfileError, ModelNotFound
from corral.options import IGNORED_OPTIONS, coerce_option
from corral.registry import manifest as mt
from corral.registry.derive import Quantizer, check_adapter, quantize_layer
from corral.registry.draft import check_draft
from corral.registry.gguf import GGUFInfo, human_parameter_count, inspect_gguf
from corral.registry.manifest import Layer, Manifest, canonical_digest
from corral.registry.modelfile import ROLES
from corral.registry.projector import is_projector, projector_problem
from corral.registry.names import Name, is_valid_name, parse_name
from corral.registry.progress import Progress, quiet
from corral.registry.store import Store


# (projector GGUF, text model GGUF) -> why the projector does not load beside it, or None
ProjectorCheck = Callable[[str, str], "str | None"]


@dataclass
class CreateRequest:
    """The JSON create form of /api/create."""

    model: str
    from_: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    draft: str | None = None  # a stored model whose weights draft for this one (DRAFT)
    draft_files: dict[str, str] = field(default_factory=dict)  # or an uploaded GGUF
    quantize: str | None = None  # a type name the quantizer accepts, e.g. q4_K_M
    requantize: bool = False  # allow an already-quantized source (quality drops)


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise ModelfileError("messages must be a list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content", ""), str):
            raise ModelfileError('message role must be one of "system", "user", or "assistant"')
        out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def _validate_parameters(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ModelfileError("parameters must be an object")
    return {k: coerce_option(k, v) for k, v in params.items()
            if v is not None and k not in IGNORED_OPTIONS}


def _model_config(info: GGUFInfo) -> dict[str, Any]:
    machine = platform.machine().lower()
    return {
        "model_format": "gguf",
        "model_family": info.architecture,
        "model_families": [info.architecture],
        "model_type": human_parameter_count(info.parameter_count),
        "file_type": info.quantization,
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine),
        "os": sys.platform if sys.platform != "darwin" else "darwin",
    }


def _base(store: Store, req: CreateRequest, progress: Progress
          ) -> tuple[list[Layer], dict[str, Any], dict[str, Any]]:
    """The layers, config and parameters a create starts from: `from`, then `files`."""
    base_layers: list[Layer] = []
    config: dict[str, Any] = {}
    base_params: dict[str, Any] = {}
    if req.from_:
        if not is_valid_name(req.from_):
            raise ModelfileError(f"invalid model name {req.from_!r} in 'from'")
        _, base = store.read_manifest(req.from_)
        base_layers = list(base.layers)
        config = json.loads(store.read_blob(base.config.digest))
        for layer in base.layers_of(mt.PARAMS):
            base_params = json.loads(store.read_blob(layer.digest))
    if req.files:
        base_layers, config = _with_files(store, req.files, base_layers, config, progress)
    if not any(ly.media_type == mt.MODEL for ly in base_layers):
        raise ModelfileError("the model has no weights layer")
    return base_layers, config, base_params


def _with_files(store: Store, files: dict[str, str], layers: list[Layer],
                config: dict[str, Any], progress: Progress
                ) -> tuple[list[Layer], dict[str, Any]]:
    """Uploaded GGUFs: weights replace the base's, and a CLIP GGUF is a vision projector
    (as Ollama treats a second FROM), checked against the weights it will serve."""
    models: list[Layer] = []
    projectors: list[Layer] = []
    for filename, digest in files.items():
        _check_filename(filename)
        digest = canonical_digest(digest)
        if any(ly.digest == digest for ly in models + projectors):
            continue  # each blob is parsed once, however often it is named
        if not store.has_blob(digest):
            raise ModelNotFound(f"blob {digest} not found")
        progress({"status": "parsing GGUF"})
        try:
            info = store.gguf_info(digest)
        except InvalidModelFile:
            raise InvalidModelFile("supplied file was not in GGUF format") from None
        if is_projector(info):
            projectors.append(Layer(mt.PROJECTOR, digest, store.blob_size(digest)))
        else:
            config = _model_config(info)
            models.append(Layer(mt.MODEL, digest, store.blob_size(digest)))
    if len(projectors) > 1:
        raise ModelfileError("a model takes one vision projector")
    if models:
        layers = models + [ly for ly in layers if ly.media_type not in (mt.MODEL, mt.PROJECTOR)]
    if projectors:
        model = next((ly for ly in layers if ly.media_type == mt.MODEL), None)
        if model is not None:
            problem = projector_problem(store.gguf_info(projectors[0].digest),
                                        store.gguf_info(model.digest))
            if problem:
                raise ModelfileError(problem)
        layers = [ly for ly in layers if ly.media_type != mt.PROJECTOR] + projectors
    return layers, config


def create_model(store: Store, req: CreateRequest, progress: Progress = quiet,
                 prune: bool = True, quantizer: Quantizer | None = None,
                 load_projector: ProjectorCheck | None = None) -> Name:
    """Build layers for `req` and write the manifest last. `load_projector` tries a
    projector the way the runner will load it (the daemon's runs a child)."""
    name = parse_name(req.model)
    if not req.from_ and not req.files:
        raise ModelfileError("neither 'from' or 'files' was specified")
    base_layers, config, base_params = _base(store, req, progress)
    projector = next((ly for ly in base_layers if ly.media_type == mt.PROJECTOR), None)
    if projector is not None and load_projector is not None and req.files:
        progress({"status": "loading the projector"})
        model = next(ly for ly in base_layers if ly.media_type == mt.MODEL)
        problem = load_projector(str(store.blob_path(projector.digest)),
                                 str(store.blob_path(model.digest)))
        if problem:
            raise ModelfileError(f"the projector does not load: {problem}")
    if req.quantize:
        model = next(ly for ly in base_layers if ly.media_type == mt.MODEL)
        quantized = quantize_layer(store, model, req.quantize, req.requantize, quantizer,
                                   progress)
        base_layers = [quantized if ly is model else ly for ly in base_layers]
        config = {**config, **_model_config(store.gguf_info(quantized.digest))}
    if req.adapters:
        base_layers = _with_adapters(store, req, base_layers, progress)
    base_layers = _with_draft(store, req, base_layers)  # or the base's, checked again

    layers = list(base_layers)

    def put_text(media_type: str, text: str, replace: bool = True) -> None:
        nonlocal layers
        if replace:
            aliases = {mt.TEMPLATE, mt.PROMPT} if media_type == mt.TEMPLATE else {media_type}
            layers = [ly for ly in layers if ly.media_type not in aliases]
        digest, size = _put_blob(store, text.encode(), progress)
        layers.append(Layer(media_type, digest, size))

    if req.template is not None:
        put_text(mt.TEMPLATE, req.template)
    if req.system is not None:
        put_text(mt.SYSTEM, req.system)
    params = {**base_params, **_validate_parameters(req.parameters)}
    if params != base_params or (params and not base_params):
        put_text(mt.PARAMS, json.dumps(params, separators=(",", ":")))
    if req.messages is not None:
        put_text(mt.MESSAGES, json.dumps(_validate_messages(req.messages)))
    for text in req.license:
        if not any(ly.media_type == mt.LICENSE and store.read_blob(ly.digest) == text.encode()
                   for ly in layers):
            put_text(mt.LICENSE, text, replace=False)

    config_digest, config_size = _put_blob(store, json.dumps(config).encode(), progress)
    manifest = Manifest(Layer(mt.CONFIG_MEDIA_TYPE, config_digest, config_size), tuple(layers))
    _write_manifest(store, name, manifest, progress, prune)
    return name


def _with_adapters(store: Store, req: CreateRequest, layers: list[Layer],
                   progress: Progress) -> list[Layer]:
    """Replace the adapters with `req.adapters`, each checked against the model first."""
    model = next(ly for ly in layers if ly.media_type == mt.MODEL)
    base = store.gguf_info(model.digest)
    adapters = []
    for filename, digest in req.adapters.items():
        _check_filename(filename)
        digest = canonical_digest(digest)
        if not store.has_blob(digest):
            raise ModelNotFound(f"blob {digest} not found")
        try:
            info = store.gguf_info(digest)
        except InvalidModelFile:
            raise InvalidModelFile("the adapter was not in GGUF format") from None
        check_adapter(base, info)
        adapters.append(Layer(mt.ADAPTER, digest, store.blob_size(digest)))
    return [ly for ly in layers if ly.media_type != mt.ADAPTER] + adapters


def _with_draft(store: Store, req: CreateRequest, layers: list[Layer]) -> list[Layer]:
    """The draft model `req` names (a stored model's weights, or an uploaded GGUF), or the
    base's, checked against the weights it will draft for (registry/draft.py)."""
    if req.draft and req.draft_files:
        raise ModelfileError("name a draft model or upload its file, not both")
    if len(req.draft_files) > 1:
        raise ModelfileError("a model takes one draft model")
    drafts = [ly for ly in layers if ly.media_type == mt.DRAFT]
    if req.draft:
        if not is_valid_name(req.draft):
            raise ModelfileError(f"invalid model name {req.draft!r} in 'draft'")
        entry = store.entry(req.draft)  # ModelNotFound: a 404
        weights = entry.manifest.layers_of(mt.MODEL)
        if not weights:
            raise ModelfileError(f"the draft model {req.draft!r} has no weights layer")
        drafts = [Layer(mt.DRAFT, weights[0].digest, weights[0].size, entry.name.display())]
    for filename, digest in req.draft_files.items():
        _check_filename(filename)
        digest = canonical_digest(digest)
        if not store.has_blob(digest):
            raise ModelNotFound(f"blob {digest} not found")
        drafts = [Layer(mt.DRAFT, digest, store.blob_size(digest))]
    if not drafts:
        return layers
    # No progress line before the check: a mismatch after a `from` is then a 400, not an
    # error inside a 200 stream.
    model = next(ly for ly in layers if ly.media_type == mt.MODEL)
    check_draft(store, model.digest, drafts[0].digest)
    return [ly for ly in layers if ly.media_type != mt.DRAFT] + drafts


def _put_blob(store: Store, data: bytes, progress: Progress) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if store.has_blob(digest):
        progress({"status": f"using existing layer {digest}"})
        return digest, len(data)
    progress({"status": f"creating new layer {digest}"})
    return store.write_blob_bytes(data, digest)


def _write_manifest(store: Store, name: Name, manifest: Manifest, progress: Progress,
                    prune: bool) -> None:
    progress({"status": "writing manifest"})
    with store.lock:  # no delete or copy of this name in between
        old: set[str] = set()
        if store.resolve(name) is not None:
            old = store.read_manifest(name)[1].digests()
        store.write_manifest(name, manifest.to_bytes())
        if prune and old:
            for digest in old - store.referenced_digests():
                store.delete_blob(digest)
    progress({"status": "success"})


def _check_filename(filename: str) -> None:
    if (not isinstance(filename, str) or not filename or filename.startswith(("/", "\\"))
            or ".." in Path(filename).parts or "\x00" in filename or ":" in filename):
        raise ModelfileError(f"invalid file name {filename!r}")


def looks_like_path(ref: str) -> bool:
    """FROM is a path by its syntax alone, so the answer never depends on what exists."""
    if ref.startswith(("/", "./", "../", "~", ".\\")) or ref.lower().endswith(".gguf"):
        return True
    return os.sep in ref and not is_valid_name(ref)


def local_model_file(ref: str, base_dir: Path) -> Path:
    """A FROM path, resolved against the Modelfile's folder and checked to be a GGUF.

    A path that is missing, unreadable, not a regular file or not a valid GGUF
    gets the same error, so the answer says nothing about what exists.
    """
    path = Path(os.path.expanduser(ref))
    if not path.is_absolute():
        path = base_dir / path
    try:
        inspect_gguf(path)
    except InvalidModelFile:
        raise InvalidModelFile(f"{path}: invalid model file") from None
    return path
