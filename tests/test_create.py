"""Modelfile parsing and create: layers first, manifest last, safe FROM paths."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from corral.errors import CorralError, InvalidModelFile, ModelfileError, ModelNotFound, NoSpace
from corral.registry import manifest as mt
from corral.registry.create import (
    CreateRequest,
    create_model,
    local_model_file,
    looks_like_path,
)
from corral.registry.modelfile import Modelfile, format_modelfile, parse_modelfile
from corral.registry.models import Records
from corral.registry.names import Name, parse_name
from corral.registry.progress import Progress, quiet
from corral.registry.store import Store
from tests.gguf_files import write_tiny_gguf


def create_from_modelfile(store: Store, model: str, mf: Modelfile, base_dir: Path,
                          progress: Progress = quiet) -> Name:
    """What `corral create` does, with the upload replaced by a direct store import."""
    req = CreateRequest(model=model, template=mf.template, system=mf.system,
                        license=list(mf.licenses), parameters=dict(mf.parameters),
                        messages=mf.messages)
    if looks_like_path(mf.from_):
        path = local_model_file(mf.from_, base_dir)
        with path.open("rb") as f:
            req.files = {path.name: store.write_blob(iter(lambda: f.read(1 << 20), b""))[0]}
    else:
        req.from_ = mf.from_
    return create_model(store, req, progress)

MODELFILE = '''
# a comment
from ./tiny.gguf
PARAMETER temperature 0.25
PARAMETER stop "User:"
PARAMETER stop <end>
PARAMETER num_ctx 2048
TEMPLATE """{{ .System }}
{{ .Prompt }}"""
SYSTEM You are terse.
LICENSE """line one
line two"""
LICENSE MIT
MESSAGE user hello
MESSAGE assistant hi
'''


def test_parse_every_instruction() -> None:
    mf = parse_modelfile(MODELFILE)
    assert mf.from_ == "./tiny.gguf"
    assert mf.parameters == {"temperature": 0.25, "stop": ["User:", "<end>"], "num_ctx": 2048}
    assert mf.template == "{{ .System }}\n{{ .Prompt }}"
    assert mf.system == "You are terse."
    assert mf.licenses == ["line one\nline two", "MIT"]
    assert mf.messages == [{"role": "user", "content": "hello"},
                           {"role": "assistant", "content": "hi"}]
    again = parse_modelfile(format_modelfile(mf.from_, mf.parameters, mf.template, mf.system,
                                             mf.licenses, mf.messages))
    assert again == mf


@pytest.mark.parametrize("text,message", [
    ("PARAMETER temperature 1", "no FROM line"),
    ("FROM x\nBOGUS y", "command must be one of"),
    ("FROM x\nPARAMETER nonsense 1", "unknown parameter 'nonsense'"),
    ("FROM x\nPARAMETER top_k many", "must be a number"),
    ("FROM x\nPARAMETER temperature nan", "finite"),
    ("FROM x\nPARAMETER top_k -1", "out of range"),
    ("FROM x\nMESSAGE robot hi", "message role must be one of"),
    ('FROM x\nSYSTEM """never closed', "unterminated"),
])
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ModelfileError, match=message):
        parse_modelfile(text)


def test_deprecated_parameters_are_ignored() -> None:
    assert parse_modelfile("FROM x\nPARAMETER mirostat 1").parameters == {}


def test_from_path_or_name_is_decided_by_syntax() -> None:
    for path in ("/etc/passwd", "./m.gguf", "../m", "~/m.gguf", "model.GGUF", "a/b/c/d/e"):
        assert looks_like_path(path)
    for name in ("llama3.2", "gemma3:270m-base", "hf.co/u/r:Q4_K_M", "ns/model"):
        assert not looks_like_path(name)


def test_create_from_gguf_path(store: Store, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    events: list[dict] = []
    name = create_from_modelfile(store, "mine:v1", parse_modelfile(MODELFILE), tmp_path,
                                 events.append)
    assert name.display() == "mine:v1"
    assert events[-2:] == [{"status": "writing manifest"}, {"status": "success"}]
    _, manifest = store.read_manifest("mine:v1")
    kinds = [ly.media_type for ly in manifest.layers]
    assert kinds == [mt.MODEL, mt.TEMPLATE, mt.SYSTEM, mt.PARAMS, mt.MESSAGES, mt.LICENSE,
                     mt.LICENSE]
    config = json.loads(store.read_blob(manifest.config.digest))
    assert config["model_format"] == "gguf" and config["model_family"] == "llama"
    assert config["file_type"] == "F32"
    params = json.loads(store.read_blob(manifest.layers_of(mt.PARAMS)[0].digest))
    assert params["stop"] == ["User:", "<end>"]


def test_create_from_existing_model_inherits_and_overrides(store: Store, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create_from_modelfile(store, "base", parse_modelfile(MODELFILE), tmp_path)
    child = parse_modelfile("FROM base\nSYSTEM Be verbose.\nPARAMETER temperature 0.9")
    create_from_modelfile(store, "child", child, tmp_path)
    _, base = store.read_manifest("base")
    _, manifest = store.read_manifest("child")
    assert manifest.layers_of(mt.MODEL) == base.layers_of(mt.MODEL)
    assert manifest.layers_of(mt.TEMPLATE) == base.layers_of(mt.TEMPLATE)
    assert store.read_blob(manifest.layers_of(mt.SYSTEM)[0].digest) == b"Be verbose."
    params = json.loads(store.read_blob(manifest.layers_of(mt.PARAMS)[0].digest))
    assert params["temperature"] == 0.9 and params["num_ctx"] == 2048


def test_records_are_built_again_only_when_the_manifest_changes(store: Store,
                                                                 tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    name = create_from_modelfile(store, "mine", parse_modelfile(MODELFILE), tmp_path)
    records = Records(store)
    first = records.get(name)
    assert first.system == "You are terse." and records.get(name) is first
    store.copy("mine", parse_name("other"))  # another name's manifest changes nothing here
    assert records.get(name) is first
    changed = parse_modelfile(MODELFILE.replace("You are terse.", "Be brief."))
    create_from_modelfile(store, "mine", changed, tmp_path)
    second = records.get(name)
    assert second is not first and second.system == "Be brief."
    store.delete(name)
    with pytest.raises(ModelNotFound):
        records.get(name)


def test_json_form_with_uploaded_blob(store: Store, tmp_path: Path) -> None:
    digest, _ = store.write_blob_bytes(write_tiny_gguf(tmp_path / "t.gguf").read_bytes())
    create_model(store, CreateRequest(model="viajson", files={"t.gguf": digest},
                                      parameters={"top_k": 5}, license=["L"]))
    assert store.entry("viajson").manifest.layers[0].digest == digest


@pytest.mark.parametrize("req,error,message", [
    (CreateRequest(model="x"), ModelfileError, "neither 'from' or 'files'"),
    (CreateRequest(model="x", from_="missing"), ModelNotFound, "not found"),
    (CreateRequest(model="x", files={"a.gguf": "sha256:" + "0" * 64}), ModelNotFound, "blob"),
    (CreateRequest(model="x", files={"../a.gguf": "sha256:" + "0" * 64}), ModelfileError,
     "invalid file name"),
    (CreateRequest(model="../x", from_="base"), Exception, "invalid model name"),
    (CreateRequest(model="x", from_="/etc/passwd"), ModelfileError, "invalid model name"),
    (CreateRequest(model="x", files={"a": "sha256:../../etc/passwd"}), Exception, "digest"),
])
def test_json_form_errors(store: Store, req: CreateRequest, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        create_model(store, req)
    assert store.list_models() == []


def test_non_gguf_blob_is_refused(store: Store) -> None:
    digest, _ = store.write_blob_bytes(b"#!/bin/sh\necho not a model\n")
    with pytest.raises(InvalidModelFile, match="supplied file was not in GGUF format"):
        create_model(store, CreateRequest(model="x", files={"x.gguf": digest}))
    assert store.list_models() == []


def _fail_after(seconds: int) -> None:
    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("FROM blocked")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def test_bad_from_paths_get_one_message_and_never_block(store: Store, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    link = tmp_path / "link.gguf"
    link.symlink_to("/etc/passwd")
    (tmp_path / "text.gguf").write_text("hello")
    paths = ["/etc/passwd", "/dev/random", "/dev/zero", "/proc/self/environ", str(fifo),
             str(link), str(tmp_path / "text.gguf"), str(tmp_path / "missing.gguf"),
             str(tmp_path)]
    messages = set()
    assert threading.current_thread() is threading.main_thread()
    _fail_after(20)
    try:
        for path in paths:
            with pytest.raises(InvalidModelFile) as info:
                create_from_modelfile(store, "x", parse_modelfile(f"FROM {path}"), tmp_path)
            messages.add(info.value.message.replace(path, "<path>"))
    finally:
        signal.alarm(0)
    assert messages == {"<path>: invalid model file"}
    assert store.list_models() == []
    assert not store.blobs.exists() or list(store.blobs.iterdir()) == []


def test_overwrite_prunes_layers_no_longer_used(store: Store, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    create_from_modelfile(store, "m", parse_modelfile("FROM ./tiny.gguf\nSYSTEM one"), tmp_path)
    old_system = store.read_manifest("m")[1].layers_of(mt.SYSTEM)[0].digest
    create_from_modelfile(store, "m", parse_modelfile("FROM ./tiny.gguf\nSYSTEM two"), tmp_path)
    assert not store.has_blob(old_system)


def _tiny_blob(store: Store, tmp_path: Path) -> str:
    with write_tiny_gguf(tmp_path / "tiny.gguf").open("rb") as f:
        return store.write_blob(iter(lambda: f.read(1 << 20), b""))[0]


def test_quantize_that_fails_half_way_leaves_no_blob(store: Store, tmp_path: Path) -> None:
    digest = _tiny_blob(store, tmp_path)
    before = sorted(os.listdir(store.blobs))
    written: list[Path] = []

    def half_then_crash(src: Path, dst: Path, type_name: str, requantize: bool,
                        progress: Any) -> None:
        dst.write_bytes(b"GGUF" + b"\0" * 4096)  # what a child killed mid-write leaves
        written.append(dst)
        progress(1, 2, "token_embd.weight")
        raise CorralError("quantizing failed (signal 9): ")

    req = CreateRequest(model="q", files={"tiny.gguf": digest}, quantize="q8_0")
    with pytest.raises(CorralError, match="signal 9"):
        create_model(store, req, quantizer=half_then_crash)
    assert written and not written[0].exists()
    assert sorted(os.listdir(store.blobs)) == before and store.list_models() == []

    def garbage(src: Path, dst: Path, type_name: str, requantize: bool, progress: Any) -> None:
        dst.write_bytes(b"not a gguf")

    with pytest.raises(CorralError, match="invalid model file"):
        create_model(store, req, quantizer=garbage)
    assert sorted(os.listdir(store.blobs)) == before


def test_quantize_checks_space_first(tmp_path: Path) -> None:
    # A store of 8 MB: no room for a quantized copy plus the margin, on any disk.
    store = Store(tmp_path / "models", capacity=8 << 20)
    digest = _tiny_blob(store, tmp_path)
    calls: list[Path] = []
    req = CreateRequest(model="q", files={"tiny.gguf": digest}, quantize="q8_0")
    with pytest.raises(NoSpace, match="no space left on device"):
        create_model(store, req, quantizer=lambda *args: calls.append(args[1]))
    assert calls == [] and os.listdir(store.blobs) == [digest.replace(":", "-")]


def test_rpc_servers_parameter_in_a_modelfile() -> None:
    mf = parse_modelfile("FROM x\nPARAMETER rpc_servers 10.0.0.2:50052,[::1]:50053")
    assert mf.parameters == {"rpc_servers": "10.0.0.2:50052,[::1]:50053"}
    with pytest.raises(ModelfileError, match="not host:port"):
        parse_modelfile("FROM x\nPARAMETER rpc_servers nowhere")
