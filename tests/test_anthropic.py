"""Anthropic's Messages API with the official `anthropic` client and raw SSE."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from corral.server.daemon import Daemon
from tests.support import DaemonFactory
from tests.test_reasoning import ASK, CALL, THINKER, THOUGHT, daemon  # noqa: F401

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
SAMPLING: dict[str, Any] = {"max_tokens": 60}
# THINKER's template thinks unless told not to (Ollama's default); the call tests want none.
NO_THINK: dict[str, Any] = {"thinking": {"type": "disabled"}}
GREEDY = {"temperature": 0, "top_k": 1}  # newer SDKs send these only as extra body fields


def client(d: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0)


def sse(d: Daemon, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    with httpx.stream("POST", d.url + "/v1/messages", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(
            "text/event-stream")
        name = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append((name, data))
    return events


@pytest.mark.model
def test_tool_use_whole_and_streamed(daemon: Daemon) -> None:  # noqa: F811
    c = client(daemon)
    msg = c.messages.create(model=THINKER, messages=ASK, tools=[TOOL], system="Be brief.",
                            extra_body={"grammar": CALL, **GREEDY}, **SAMPLING, **NO_THINK)
    assert msg.stop_reason == "tool_use" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    text, use = msg.content
    assert text.type == "text" and text.text == "Checking. "
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"}  # type: ignore[arg-type]
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    with c.messages.stream(model=THINKER, messages=ASK, tools=[TOOL], **NO_THINK,
                           extra_body={"grammar": CALL, **GREEDY}, **SAMPLING) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.stop_reason == "tool_use"

    # The tool's answer goes back as a tool_result; the conversation goes on.
    follow = c.messages.create(model=THINKER, tools=[TOOL], messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 21 C"}]}],
        extra_body={"grammar": 'root ::= "It is sunny."', **GREEDY}, **SAMPLING, **NO_THINK)
    assert follow.stop_reason == "end_turn" and follow.content[0].type == "text"


@pytest.mark.model
def test_event_sequence_with_thinking(daemon: Daemon) -> None:  # noqa: F811
    events = sse(daemon, {"model": THINKER, "messages": ASK, "stream": True,
                          "thinking": {"type": "enabled", "budget_tokens": 1024},
                          "grammar": THOUGHT, **GREEDY, **SAMPLING})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    for index in (0, 1):  # every block opens, takes deltas, and closes, in order
        mine = [n for n, d in events if d.get("index") == index]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
        assert set(mine[1:-1]) == {"content_block_delta"}
    kinds = {d["delta"]["type"] for n, d in events if n == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta"}
    final = dict(events)["message_delta"]
    assert final["delta"]["stop_reason"] == "end_turn" and final["usage"]["output_tokens"] > 0
    with client(daemon).messages.stream(model=THINKER, messages=ASK,
                                        thinking={"type": "enabled", "budget_tokens": 1024},
                                        extra_body={"grammar": THOUGHT, **GREEDY}, **SAMPLING) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert "think>" not in message.content[1].text  # type: ignore[union-attr]


@pytest.mark.model
def test_errors_in_anthropics_shape(daemon: Daemon) -> None:  # noqa: F811
    c = client(daemon)
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="nope", messages=ASK, max_tokens=5)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    r = httpx.post(daemon.url + "/v1/messages", json={"model": THINKER, "messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    # Thinking asked of a model that cannot think: this route drops it (Claude Code asks
    # every model to think), where Ollama's own route refuses it. It loads the model:
    # httpx's 5 s default is too short on a busy machine (a clean clone's CI with a
    # second suite beside it timed out here).
    r = httpx.post(daemon.url + "/v1/messages", json={
        "model": "smollm2:135m", "messages": ASK, "max_tokens": 5,
        "thinking": {"type": "enabled", "budget_tokens": 100}}, timeout=300)
    assert r.status_code == 200 and "thinking" not in [b["type"] for b in r.json()["content"]]
    r = httpx.post(daemon.url + "/api/chat", json={
        "model": "smollm2:135m", "messages": ASK, "think": True, "stream": False},
        timeout=300)
    assert r.status_code == 400 and "does not support thinking" in r.json()["error"]


def test_api_key_via_x_api_key(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(None, API_KEY="sekrit")
    r = httpx.post(d.url + "/v1/messages", json={"model": "m", "messages": ASK,
                                                  "max_tokens": 5})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    c = anthropic.Anthropic(base_url=d.url, api_key="sekrit", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):  # past the key check: no such model
        c.messages.create(model="m", messages=ASK, max_tokens=5)  # type: ignore[arg-type]
