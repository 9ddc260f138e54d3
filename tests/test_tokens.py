"""Token counting that matches what is evaluated, and the model's tokenizer over HTTP.

Each count is compared with the same request run cold (its model unloaded first, so
nothing of the prompt is in any cache): the count must be the tokens it evaluated. The
tokenizer routes are compared with llama.cpp's tokenizer through llama-cpp-python's
own API on the same GGUF, which is what llama-server runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import ollama
import openai
import pytest

from corral.api.wire import parse
from corral.api.wire.native import ChatRequest, GenerateRequest
from corral.registry.store import Store
from corral.server.daemon import Daemon
from corral.server.dialects.native import parse_chat, parse_generate
from corral.server.pipeline.count import count

pytestmark = pytest.mark.model

CHAT, BASE = "smollm2:135m", "gemma3:270m-base"
TOOLFUL = "toolful"  # SmolLM2 with a template that lists tools (its own lists none)
TEMPLATE = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- if .Tools }}<|im_start|>system
You may call:{{ range .Tools }} {{ .Function.Name }}: {{ .Function.Description }}.{{ end }}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{{ end }}
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = "You answer in one word."
ONE = {"num_predict": 1, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("tokens"), NUM_PARALLEL="1")
    ollama.Client(host=d.url).create(model=TOOLFUL, from_=CHAT, template=TEMPLATE)
    yield d
    d.shutdown()


def post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120)


def unload(d: Daemon, model: str) -> None:
    """No runner, so no slot and no prompt cache: the next request of `model` is cold."""
    r = post(d, "/api/generate", {"model": model, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"


def test_a_chat_counts_what_it_evaluates(daemon: Daemon) -> None:
    body = {"model": TOOLFUL, "messages": [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "stream": False, "options": ONE}
    unload(daemon, TOOLFUL)
    counted = count(daemon.services, parse_chat(parse(ChatRequest, body)))
    cold = post(daemon, "/api/chat", body).json()
    assert cold["prompt_eval_count"] == counted
    # The system prompt and the tools are in it: the same chat without them is shorter.
    bare = {**body, "messages": body["messages"][1:], "tools": []}
    assert count(daemon.services, parse_chat(parse(ChatRequest, bare))) < counted - 20
    # The same request again reuses its prefix: the cold one was the whole prompt.
    assert post(daemon, "/api/chat", body).json()["prompt_eval_count"] < counted


def test_a_raw_generate_counts_what_it_evaluates(daemon: Daemon) -> None:
    body = {"model": BASE, "prompt": "Once upon a time, in a land far away,", "raw": True,
            "stream": False, "options": ONE}
    unload(daemon, BASE)
    counted = count(daemon.services, parse_generate(parse(GenerateRequest, body)))
    assert post(daemon, "/api/generate", body).json()["prompt_eval_count"] == counted
    # Raw text is tokenized as it stands, after the model's BOS.
    ids = post(daemon, "/tokenize", {"model": BASE, "content": body["prompt"],
                                     "add_special": True}).json()["tokens"]
    assert len(ids) == counted
    unload(daemon, BASE)


def test_anthropic_count_tokens_matches_a_cold_message(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    tools: Any = [{"name": "get_weather", "description": "Weather in a city",
                   "input_schema": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    unload(daemon, TOOLFUL)
    counted = client.messages.count_tokens(model=TOOLFUL, system=SYSTEM, messages=ask,
                                           tools=tools)
    reply = client.messages.create(model=TOOLFUL, system=SYSTEM, messages=ask, tools=tools,
                                   max_tokens=1)
    assert reply.usage.cache_read_input_tokens == 0  # cold: everything evaluated
    assert counted.input_tokens == reply.usage.input_tokens > 20


def test_responses_input_tokens_match_a_cold_response(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Weather",
                   "parameters": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]
    unload(daemon, TOOLFUL)
    counted = client.responses.input_tokens.count(model=TOOLFUL, instructions=SYSTEM,
                                                  input="Weather in Paris?", tools=tools)
    assert counted.object == "response.input_tokens"
    reply = client.responses.create(model=TOOLFUL, instructions=SYSTEM, input="Weather in Paris?",
                                    tools=tools, max_output_tokens=1, temperature=0)
    assert reply.usage is not None and reply.usage.input_tokens_details.cached_tokens == 0
    assert counted.input_tokens == reply.usage.input_tokens > 20


def test_tokenize_is_llama_cpps(daemon: Daemon, chat_gguf: Path) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(str(chat_gguf), vocab_only=True, verbose=False)
    text = "<|im_start|>user\nA llama: \U0001f999!"
    for special in (True, False):
        want = vocab.tokenize(text.encode(), add_bos=False, special=special)
        got = post(daemon, "/tokenize", {"model": CHAT, "content": text,
                                         "parse_special": special}).json()["tokens"]
        assert got == want
    assert post(daemon, "/api/tokenize", {"model": CHAT, "content": text}).json() == \
        {"tokens": vocab.tokenize(text.encode(), add_bos=False, special=True)}
    pieces = post(daemon, "/tokenize", {"model": CHAT, "content": text,
                                        "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == vocab.tokenize(text.encode(), add_bos=False,
                                                       special=True)
    # The llama is split over byte tokens: those pieces are bytes, the others text.
    assert any(isinstance(p["piece"], list) for p in pieces)
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list)
                      else p["piece"].encode() for p in pieces)
    assert joined == text.encode()
    ids = [p["id"] for p in pieces]
    assert post(daemon, "/detokenize", {"model": CHAT, "tokens": ids}).json() == \
        {"content": text}
    assert post(daemon, "/api/detokenize", {"model": CHAT, "tokens": ids}).json() == \
        {"content": vocab.detokenize(ids, special=True).decode()}


def test_the_model_may_be_left_out_when_one_is_loaded(daemon: Daemon) -> None:
    for model in (CHAT, BASE, TOOLFUL):
        unload(daemon, model)
    r = post(daemon, "/tokenize", {"content": "hi"})
    assert r.status_code == 400 and "no model is loaded" in r.json()["error"]["message"]
    post(daemon, "/api/generate", {"model": CHAT})  # loaded
    named = post(daemon, "/tokenize", {"model": CHAT, "content": "hi"}).json()
    assert post(daemon, "/tokenize", {"content": "hi"}).json() == named
    assert post(daemon, "/detokenize", {"tokens": named["tokens"]}).json() == {"content": "hi"}
    post(daemon, "/api/generate", {"model": BASE})
    r = post(daemon, "/tokenize", {"content": "hi"})
    assert r.status_code == 400 and "2 models are loaded" in r.json()["error"]["message"]
    unload(daemon, BASE)


def test_a_token_outside_the_vocabulary_is_a_400(daemon: Daemon) -> None:
    for path in ("/detokenize", "/api/detokenize"):
        r = post(daemon, path, {"model": CHAT, "tokens": [1, 10**9]})
        assert r.status_code == 400 and "not in the vocabulary" in r.text


def test_embeddings_over_the_context_without_truncation_are_a_400(daemon: Daemon) -> None:
    long = "word " * 3000  # over the tests' 1024-token context
    native = post(daemon, "/api/embed", {"model": CHAT, "input": long, "truncate": False})
    r = post(daemon, "/v1/embeddings", {"model": CHAT, "input": long, "truncate": False})
    assert native.status_code == r.status_code == 400
    assert r.json()["error"]["message"] == native.json()["error"]
    assert post(daemon, "/v1/embeddings", {"model": CHAT, "input": long}).status_code == 200
