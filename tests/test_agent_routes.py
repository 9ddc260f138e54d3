"""The coding agents' own requests, answered: Claude Code's, Codex's and OpenCode's bodies
as they recorded them (tests/peers/agents/), against a model made from the chat starter
with a template that renders tools; and the pieces of each route they rely on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.test_reasoning import TEMPLATE as THINKING, THOUGHT

pytestmark = pytest.mark.model

PEERS = Path(__file__).parent / "peers"
FIXTURES = sorted((PEERS / "agents").glob("*.json"))
AGENT = "agent"
THINKER = "thinker"
# ChatML with tools in the system turn and calls in <tool_call> tags (Qwen's layout).
TEMPLATE = """{{- if or .System .Tools }}<|im_start|>system
{{ .System }}{{ if .Tools }}
Tools:{{ range .Tools }} {{ .Function.Name }}{{ end }}. Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ end }}<|im_end|>
{{ end }}
{{- range .Messages }}
{{- if eq .Role "tool" }}<|im_start|>user
<tool_response>{{ .Content }}</tool_response><|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ range .ToolCalls }}<tool_call>{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}</tool_call>{{ end }}<|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}
{{- end }}<|im_start|>assistant
"""
# A short answer whatever the agent asks: a line, greedily.
SHORT = {"stop": ["<|im_end|>", "\n"], "temperature": 0}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("agents"))
    client = ollama.Client(host=d.url)
    client.create(model=AGENT, from_="smollm2:135m", template=TEMPLATE, parameters=SHORT)
    client.create(model=THINKER, from_="smollm2:135m", template=THINKING,
                  parameters={"temperature": 0})
    yield d
    d.shutdown()


def recorded(path: Path, stream: bool) -> tuple[str, dict[str, str], dict[str, Any]]:
    """A recorded request, bounded to a few tokens: the path, headers and body to send."""
    fixture = json.loads(path.read_text())
    body = {**fixture["body"], "stream": stream}
    body["max_tokens" if "messages" in body else "max_output_tokens"] = 8
    return fixture["path"], fixture["headers"], body


def sse(resp: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, name = [], ""
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line[6:])))
    return events


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_recorded_bodies_are_answered(daemon: Daemon, fixture: Path, stream: bool) -> None:
    path, headers, body = recorded(fixture, stream)
    with httpx.stream("POST", daemon.url + path, json=body, headers=headers,
                      timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        if not stream:
            answer = json.loads(resp.read())
            _check_whole(path, answer)
            return
        events = sse(resp)
    names = [name for name, _ in events]
    assert "error" not in names, events
    if path.startswith("/v1/messages"):
        assert names[0] == "message_start" and names[-1] == "message_stop"
        usage = events[-2][1]["usage"]
        assert 0 < usage["input_tokens"] + usage["cache_read_input_tokens"] < 1024  # as read
    elif path.startswith("/v1/responses"):
        assert names[0] == "response.created" and names[-1] == "response.completed"
        assert events[-1][1]["response"]["status"] == "completed"
    else:
        assert events[-1][1]["usage"]["prompt_tokens"] < 1024  # cut to the context, as read


def _check_whole(path: str, answer: dict[str, Any]) -> None:
    if path.startswith("/v1/messages"):
        assert answer["type"] == "message" and answer["stop_reason"] in (
            "end_turn", "max_tokens", "tool_use")
        assert not [b for b in answer["content"] if b["type"] == "thinking"]
    elif path.startswith("/v1/responses"):
        assert answer["status"] == "completed" and answer["usage"]["input_tokens"] < 1024
        tools = [t["type"] for t in answer["tools"]]
        assert "web_search" in tools and "namespace" in tools  # echoed as declared
    else:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_version_is_the_pinned_ollamas(daemon: Daemon) -> None:
    """/api/version reports the release of the Ollama source the tests compare against;
    Codex's --oss refuses anything older than 0.13.4."""
    pinned = (PEERS / "ollama" / "VERSION").read_text().strip().removeprefix("v")
    reported = httpx.get(daemon.url + "/api/version").json()["version"]
    assert reported == pinned
    release = tuple(int(p) for p in reported.split("-")[0].split("."))
    assert release >= (0, 13, 4)
    assert httpx.head(daemon.url + "/api/hello").status_code == 200  # Claude Code's warm-up


def count(d: Daemon, path: str, body: dict[str, Any]) -> int:
    resp = httpx.post(d.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["input_tokens"])


FUNCTION = {"type": "function", "name": "spawn_agent", "description": "Start a helper",
            "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Helpers",
             "tools": [FUNCTION]}
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
QUALIFIED = {**FUNCTION, "name": "multi_agent_v1.spawn_agent"}


def test_responses_tools_as_the_model_sees_them(daemon: Daemon) -> None:
    """A namespace's members are shown by qualified name, a hosted tool not at all, and
    a namespaced call in the history is rendered by its qualified name too."""
    ask = [{"role": "user", "content": "Start a helper."}]
    path = "/v1/responses/input_tokens"
    shown = count(daemon, path, {"model": AGENT, "input": ask, "tools": [QUALIFIED]})
    assert count(daemon, path, {"model": AGENT, "input": ask, "tools": [NAMESPACE]}) == shown
    assert count(daemon, path, {"model": AGENT, "input": ask, "tools": [
        NAMESPACE, {"type": "web_search", "external_web_access": False}]}) == shown
    call = {"type": "function_call", "call_id": "c1", "arguments": '{"task": "x"}'}
    history = [*ask, {**call, "name": "spawn_agent", "namespace": "multi_agent_v1"},
               {"type": "function_call_output", "call_id": "c1", "output": "started"}]
    flat = [*ask, {**call, "name": "multi_agent_v1.spawn_agent"}, history[-1]]
    assert count(daemon, path, {"model": AGENT, "input": history, "tools": [NAMESPACE]}) == \
        count(daemon, path, {"model": AGENT, "input": flat, "tools": [QUALIFIED]})


def _forced(name: str, arguments: str) -> str:
    """A grammar that makes the model call `name` with `arguments` (JSON text)."""
    text = json.dumps(f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>')
    return f"root ::= {text}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_calls_go_back_in_the_clients_shape(daemon: Daemon, stream: bool) -> None:
    tools = [NAMESPACE, CUSTOM, {"type": "web_search"}]
    items = []
    for grammar in (_forced("multi_agent_v1.spawn_agent", '{"task": "tests"}'),
                    _forced("apply_patch", '{"input": "*** Begin Patch"}')):
        body = {"model": AGENT, "input": "Go.", "tools": tools, "grammar": grammar,
                "stream": stream, "max_output_tokens": 60}
        resp = httpx.post(daemon.url + "/v1/responses", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        if stream:
            events = sse(resp)
            done = [e["item"] for name, e in events if name == "response.output_item.done"]
            items.append(done[-1])
            deltas = [name for name, _ in events if name.endswith(".delta")]
            assert deltas[-1] in ("response.function_call_arguments.delta",
                                  "response.custom_tool_call_input.delta")
        else:
            items.append(resp.json()["output"][-1])
    call, custom = items
    assert (call["type"], call["name"], call["namespace"]) == (
        "function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(call["arguments"]) == {"task": "tests"}
    assert (custom["type"], custom["name"], custom["input"]) == (
        "custom_tool_call", "apply_patch", "*** Begin Patch")
    assert "namespace" not in custom


def test_anthropic_tools_and_turns_as_the_model_sees_them(daemon: Daemon) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    tool = {"name": "Read", "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    path = "/v1/messages/count_tokens"
    shown = count(daemon, path, {"model": AGENT, "messages": ask, "tools": [tool]})
    assert count(daemon, path, {"model": AGENT, "messages": ask, "tools": [
        tool, {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
        {**tool, "name": "Later", "defer_loading": True}]}) == shown
    # A system turn among the messages is part of the prompt, where it stands.
    reminder = [*ask, {"role": "system", "content": "Be brief."}]
    assert count(daemon, path, {"model": AGENT, "messages": reminder, "tools": [tool]}) > shown


def test_thinking_display_omitted(daemon: Daemon) -> None:
    """Thinking blocks come, without their text, where the client asked to omit it."""
    body = {"model": THINKER, "max_tokens": 40, "grammar": THOUGHT,
            "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "adaptive", "display": "omitted"}}
    whole = httpx.post(daemon.url + "/v1/messages", json=body, timeout=120).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "" and whole["content"][1]["text"]
    with httpx.stream("POST", daemon.url + "/v1/messages", json={**body, "stream": True},
                      timeout=120) as resp:
        events = sse(resp)
    starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
    deltas = [e["delta"]["type"] for n, e in events if n == "content_block_delta"]
    assert starts == ["thinking", "text"] and "thinking_delta" not in deltas
    shown = httpx.post(daemon.url + "/v1/messages", timeout=120, json={
        **body, "thinking": {"type": "adaptive"}}).json()
    assert shown["content"][0]["thinking"]  # the same, shown


def test_render_takes_every_apis_body(daemon: Daemon) -> None:
    """/corral/render reads a body as its own route would: Anthropic's (a top-level
    system, a system turn among the messages), OpenAI's, the Responses API's, Ollama's."""
    def prompt(body: dict[str, Any]) -> str:
        resp = httpx.post(daemon.url + "/corral/render", json={"model": AGENT, **body},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["prompt"])

    ollama_shape = prompt({"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi"}]})
    assert prompt({"system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}) == ollama_shape
    assert prompt({"messages": [{"role": "developer", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "text", "text": "Hi"}]}]}) == ollama_shape
    assert prompt({"instructions": "Be brief.", "input": "Hi"}) == ollama_shape
    turn = prompt({"api": "anthropic", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}]})
    assert turn.rindex("<|im_start|>system") > turn.index("Hi")  # where it stood
