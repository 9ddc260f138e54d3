"""Quantize on create and LoRA adapters, end to end with the real chat starter.

The F16 source is a dequantized copy of the starter and the adapter a random LoRA
for its attention tensors, both written here with the `gguf` package."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import pytest

from corral.registry.store import Store, file_sha256
from corral.runner.llama.context import EngineConfig
from corral.runner.engine.engine import Engine
from corral.server.daemon import Daemon
from tests.f16_model import write_f16_copy, write_lora
from tests.test_engine import run

pytestmark = pytest.mark.model

CHAT = "smollm2:135m"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 24}
CORRAL = [sys.executable, "-c", "from corral.cli.launch import main; main()"]


@pytest.fixture(scope="module")
def files(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"f16": write_f16_copy(chat_gguf, root / "smol-f16.gguf"),
            "lora": write_lora(chat_gguf, root / "lora.gguf"),
            "lora_wrong_arch": write_lora(chat_gguf, root / "gemma.gguf", arch="gemma3"),
            "lora_wrong_shape": write_lora(chat_gguf, root / "bad.gguf", wrong_rank=True)}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("lifecycle"), NUM_PARALLEL="1")
    yield d
    d.shutdown()


def upload(client: ollama.Client, path: Path) -> str:
    return client.create_blob(path)


def answer(d: Daemon, model: str) -> str:
    r = httpx.post(d.url + "/api/generate", timeout=120, json={
        "model": model, "prompt": PROMPT, "raw": True, "stream": False, "options": GREEDY})
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


def create_stream(d: Daemon, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The create's events; checks that they stream live: when the first quantizing
    event arrives, the model is not listed yet (a buffered stream would come after)."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", d.url + "/api/create", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            events.append(json.loads(line))
            if events[-1]["status"].startswith("quantizing") and \
                    sum(e["status"].startswith("quantizing") for e in events) == 1:
                listed = httpx.get(d.url + "/api/tags").json()["models"]
                assert f"{body['model']}:latest" not in [m["model"] for m in listed]
    return events


def test_quantize_f16_source(daemon: Daemon, files: dict[str, Path]) -> None:
    client = ollama.Client(host=daemon.url)
    digest = upload(client, files["f16"])
    assert client.create(model="smol-f16", files={"smol.gguf": digest}).status == "success"
    source = answer(daemon, "smol-f16")
    for qtype, shown in (("q8_0", "Q8_0"), ("q4_K_M", "Q4_K_M")):
        events = create_stream(daemon, {"model": f"smol-{qtype}", "files": {"smol.gguf": digest},
                                        "quantize": qtype})
        statuses = [e["status"] for e in events]
        assert "error" not in events[-1] and statuses[-1] == "success"
        work = [e for e in events if e["status"] == f"quantizing F16 model to {shown}"]
        assert len(work) > 100 and work[-1]["completed"] == work[-1]["total"]  # per tensor
        assert [e["completed"] for e in work] == sorted(e["completed"] for e in work)
        assert "verifying conversion" in statuses
        shown_info = client.show(f"smol-{qtype}")
        assert shown_info.details.quantization_level == shown
        quantized = answer(daemon, f"smol-{qtype}")
        # Close to the source: a quantized model keeps most of the greedy continuation.
        similarity = difflib.SequenceMatcher(None, source, quantized).ratio()
        assert similarity > (0.6 if qtype == "q8_0" else 0.3), (source, quantized)
    assert client.create(model="smol-q5", files={"smol.gguf": digest},
                         quantize="q5_K_M").status == "success"  # the official client's way
    assert client.show("smol-q5").details.quantization_level == "Q5_K_M"
    sizes = {m.model: m.size for m in client.list().models}
    assert sizes["smol-q4_K_M:latest"] < sizes["smol-q8_0:latest"] < sizes["smol-f16:latest"]


def test_quantize_refusals_leave_nothing(daemon: Daemon, files: dict[str, Path]) -> None:
    blobs = daemon.store.blobs
    before = set(os.listdir(blobs))
    r = httpx.post(daemon.url + "/api/create", json={"model": "x", "from": CHAT,
                                                      "quantize": "q4_K_M"}, timeout=60)
    assert r.status_code == 400
    assert "quantization is only supported for F16, BF16 and F32 models" in r.json()["error"]
    r = httpx.post(daemon.url + "/api/create", json={"model": "x", "from": CHAT,
                                                      "quantize": "q9_Z"}, timeout=60)
    assert r.status_code == 400 and "unsupported quantization type" in r.json()["error"]
    assert set(os.listdir(blobs)) == before


def test_requantize_a_starter_with_the_flag(daemon: Daemon) -> None:
    events = create_stream(daemon, {"model": "smol-requant", "from": CHAT,
                                    "quantize": "q4_K_S", "requantize": True})
    assert events[-1] == {"status": "success"}
    assert any(e["status"].startswith("warning: requantizing a Q4_1 model") for e in events)
    shown = httpx.post(daemon.url + "/api/show", json={"model": "smol-requant"}).json()
    assert shown["details"]["quantization_level"] == "Q4_K_S"
    assert answer(daemon, "smol-requant")  # it loads and answers


def test_lora_scale_zero_equals_base_and_one_changes_it(chat_gguf: Path,
                                                        files: dict[str, Path]) -> None:
    outputs = {}
    for label, adapters in (("base", ()), ("zero", ((str(files["lora"]), 0.0),)),
                            ("one", ((str(files["lora"]), 1.0),))):
        eng = Engine(str(chat_gguf), EngineConfig(n_slots=1, num_ctx=256, adapters=adapters))
        eng.start()
        try:
            outputs[label] = run(eng, PROMPT, 16)[0]
        finally:
            eng.stop()
    assert outputs["zero"] == outputs["base"]
    assert outputs["one"] != outputs["base"]


def test_adapter_on_create_and_refusals(daemon: Daemon, files: dict[str, Path]) -> None:
    client = ollama.Client(host=daemon.url)
    lora = upload(client, files["lora"])
    assert client.create(model="smol-lora", from_=CHAT, adapters={"lora.gguf": lora}).status \
        == "success"
    assert answer(daemon, "smol-lora") != answer(daemon, CHAT)
    sizes = {m["name"]: m["size"] for m in httpx.get(daemon.url + "/api/ps").json()["models"]}
    adapter_bytes = files["lora"].stat().st_size
    assert sizes["smol-lora:latest"] - sizes[CHAT] == adapter_bytes  # the estimate counts it
    shown = client.show("smol-lora")
    assert f"ADAPTER {daemon.store.blob_path(lora)}" in (shown.modelfile or "")
    for key, message in (("lora_wrong_arch", "the adapter is for gemma3, the model is llama"),
                         ("lora_wrong_shape", "does not fit the model's")):
        digest = upload(client, files[key])
        r = httpx.post(daemon.url + "/api/create", timeout=60, json={
            "model": "smol-bad", "from": CHAT, "adapters": {"a.gguf": digest}})
        assert r.status_code == 400 and message in r.json()["error"], r.text
    not_lora = upload(client, files["f16"])
    r = httpx.post(daemon.url + "/api/create", timeout=60, json={
        "model": "smol-bad", "from": CHAT, "adapters": {"a.gguf": not_lora}})
    assert r.status_code == 400 and "not a LoRA adapter" in r.json()["error"]
    assert "smol-bad:latest" not in [m.model for m in client.list().models]


def test_cli_create_with_adapter_and_quantize(daemon: Daemon, files: dict[str, Path],
                                              tmp_path: Path) -> None:
    host, port = daemon.address
    env = dict(os.environ, CORRAL_HOST=f"{host}:{port}")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {files['f16']}\nADAPTER {files['lora']}\n")
    out = subprocess.run([*CORRAL, "create", "smol-cli", "-f", str(modelfile), "-q", "q8_0"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-1] == "success"
    assert f"copying file {file_sha256(files['lora'])}" in out.stderr
    assert "quantizing F16 model to Q8_0" in out.stderr
    shown = httpx.post(daemon.url + "/api/show", json={"model": "smol-cli"}).json()
    assert shown["details"]["quantization_level"] == "Q8_0" and "ADAPTER " in shown["modelfile"]
    bad = subprocess.run([*CORRAL, "create", "smol-cli2", "-f", str(modelfile), "-q", "q9"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.startswith("Error: unsupported quantization")
