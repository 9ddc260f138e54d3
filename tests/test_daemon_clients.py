"""The real daemon with the real model, driven by the official ollama and openai clients."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import ollama
import openai
import pytest

from corral.server.daemon import Daemon
from tests.gguf_files import write_tiny_gguf

MODEL = "gemma3:270m-base"  # completion
CHAT = "smollm2:135m"  # chat, with its GGUF's ChatML template
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url)


@pytest.fixture
def oai(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def test_generate_streaming_and_not(client: ollama.Client) -> None:
    whole = client.generate(model=MODEL, prompt="The capital of France is", options=GREEDY)
    assert whole.done and whole.response and whole.eval_count == 12
    assert whole.context and whole.total_duration and whole.prompt_eval_count
    parts = list(client.generate(model=MODEL, prompt="The capital of France is",
                                 options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].done_reason == "length"


def test_chat_streaming_and_not(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat(model=CHAT, messages=messages, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done
    parts = list(client.chat(model=CHAT, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done


def test_embed_and_legacy_embeddings(client: ollama.Client) -> None:
    out = client.embed(model=MODEL, input=["hello", "world"])
    assert len(out.embeddings) == 2
    assert abs(sum(x * x for x in out.embeddings[0]) - 1) < 1e-3
    legacy = client.embeddings(model=MODEL, prompt="hello")
    assert len(legacy.embedding) == len(out.embeddings[0])
    assert abs(sum(x * x for x in legacy.embedding) - 1) > 1e-3  # raw, not normalised


def test_list_show_ps(client: ollama.Client) -> None:
    assert MODEL in [m.model for m in client.list().models]
    info = client.show(MODEL)
    assert info.modelinfo and info.modelinfo["general.architecture"] == "gemma3"
    assert info.details.family == "gemma3" and "completion" in (info.capabilities or [])
    assert "User:" in (info.parameters or "") and info.template and info.license
    client.generate(model=MODEL, prompt="Hi", options=GREEDY)
    [running] = [m for m in client.ps().models if m.model == MODEL]
    assert running.context_length == 1024
    assert running.size_vram == 0 and running.expires_at is not None


def test_verbose_show_and_tags_details(daemon: Daemon, starter_gguf: Path) -> None:
    import httpx

    from corral.registry.gguf import inspect_gguf

    info = inspect_gguf(starter_gguf)
    plain = httpx.post(daemon.url + "/api/show", json={"model": MODEL}, timeout=30).json()
    assert "tensors" not in plain and "tokenizer.ggml.tokens" not in plain["model_info"]
    assert plain["details"]["context_length"] == info.context_length
    assert plain["details"]["embedding_length"] == info.embedding_length
    full = httpx.post(daemon.url + "/api/show", json={"model": MODEL, "verbose": True},
                      timeout=60).json()
    tensors = {t["name"]: t for t in full["tensors"]}
    assert set(tensors) == set(info.tensor_bytes)
    embd = tensors["token_embd.weight"]
    assert embd["shape"][0] == info.embedding_length and embd["type"] in ("Q4_K", "Q6_K", "Q8_0",
                                                                          "Q5_0", "Q4_0")
    tokens = full["model_info"]["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == embd["shape"][1]
    assert full["model_info"]["general.architecture"] == "gemma3"
    listed = httpx.get(daemon.url + "/api/tags").json()["models"]
    [entry] = [m for m in listed if m["model"] == MODEL]
    assert entry["capabilities"] == plain["capabilities"]
    assert entry["details"]["context_length"] == info.context_length


def test_copy_delete_and_create_from_blob(client: ollama.Client, tmp_path: Path) -> None:
    client.copy(MODEL, "mycopy:v1")
    assert "mycopy:v1" in [m.model for m in client.list().models]
    client.delete("mycopy:v1")
    assert "mycopy:v1" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("mycopy:v1")
    assert info.value.status_code == 404
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    digest = client.create_blob(tiny)
    assert digest.startswith("sha256:")
    result = client.create(model="tiny:latest", files={"tiny.gguf": digest},
                           parameters={"temperature": 0.5}, system="Be brief.")
    assert result.status == "success"
    shown = client.show("tiny")
    assert "SYSTEM \"\"\"Be brief.\"\"\"" in (shown.modelfile or "")
    assert shown.details.family == "llama"
    client.delete("tiny")


def test_unknown_model_is_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="nope:latest", prompt="x")
    assert info.value.status_code == 404 and "not found" in info.value.error


def test_openai_chat(oai: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Say hello."}]
    whole = oai.chat.completions.create(model=CHAT, messages=msgs, temperature=0, max_tokens=10)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage and whole.usage.completion_tokens > 0
    chunks = list(oai.chat.completions.create(model=CHAT, messages=msgs, temperature=0,
                                              max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_openai_json_response_format(oai: openai.OpenAI) -> None:
    import json

    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about Paris:"}],
        temperature=0, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"], "additionalProperties": False}}})
    assert isinstance(json.loads(out.choices[0].message.content or "")["city"], str)


def test_openai_completions_embeddings_models(oai: openai.OpenAI) -> None:
    comp = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                  temperature=0)
    assert comp.choices[0].text and comp.usage and comp.usage.completion_tokens == 8
    default = oai.embeddings.create(model=MODEL, input=["a", "b"])  # the SDK asks for base64
    # The same batch as floats: base64 carries the same values. (Alone, "a" may differ in
    # its last bits with the default kernels; CORRAL_DETERMINISTIC makes it the same:
    # test_deterministic.py.)
    floats = oai.embeddings.create(model=MODEL, input=["a", "b"], encoding_format="float")
    assert len(default.data) == 2
    for got, want in zip(default.data, floats.data):
        assert got.embedding == pytest.approx(want.embedding, abs=1e-6)
    ids = [m.id for m in oai.models.list()]
    assert MODEL in ids
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("missing-model")


def test_openai_base64_is_little_endian_float32(daemon: Daemon) -> None:
    import httpx

    resp = httpx.post(daemon.url + "/v1/embeddings", timeout=300,  # it may load the model
                      json={"model": MODEL, "input": "a", "encoding_format": "base64"})
    raw = base64.b64decode(resp.json()["data"][0]["embedding"])
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert abs(sum(v * v for v in values) - 1) < 1e-3
