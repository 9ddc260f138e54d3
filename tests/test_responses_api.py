"""OpenAI's Responses API with the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from corral.server.daemon import Daemon
from tests.test_reasoning import ASK, CALL, THINKER, THOUGHT, daemon  # noqa: F401


TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.model
def test_function_call_and_its_output(daemon: Daemon) -> None:  # noqa: F811
    c = client(daemon)
    r = c.responses.create(model=THINKER, input="What is the weather in Paris?", tools=[TOOL],
                           temperature=0, max_output_tokens=60, instructions="Be brief.",
                           reasoning={"effort": "none"}, extra_body={"grammar": CALL})
    assert r.status == "completed" and [i.type for i in r.output] == ["message",
                                                                     "function_call"]
    assert r.output_text == "Checking. "
    call = r.output[1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    assert r.usage is not None and r.usage.input_tokens > 0
    follow = c.responses.create(model=THINKER, tools=[TOOL], temperature=0, max_output_tokens=20,
                                reasoning={"effort": "none"},
                                input=[{"role": "user", "content": "Weather in Paris?"},
                                       {"type": "function_call", "call_id": call.call_id,
                                        "name": call.name, "arguments": call.arguments},
                                       {"type": "function_call_output", "call_id": call.call_id,
                                        "output": "Sunny"}],
                                extra_body={"grammar": 'root ::= "It is sunny."'})
    assert follow.output_text == "It is sunny." and follow.status == "completed"


@pytest.mark.model
def test_streamed_reasoning_then_message(daemon: Daemon) -> None:  # noqa: F811
    c = client(daemon)
    events = list(c.responses.create(model=THINKER, input=ASK, stream=True, temperature=0,
                                      max_output_tokens=60, reasoning={"effort": "low"},
                                      extra_body={"grammar": THOUGHT}))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert "response.reasoning_summary_text.delta" in types and \
        "response.output_text.delta" in types
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and text.endswith(".") and "think>" not in text


@pytest.mark.model
def test_refusals_in_openai_shape(daemon: Daemon) -> None:  # noqa: F811
    r = httpx.post(daemon.url + "/v1/responses", timeout=60, json={
        "model": THINKER, "input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]
    r = httpx.post(daemon.url + "/v1/responses", timeout=60, json={
        "model": THINKER, "input": "hi", "reasoning": {"effort": "ultra"}})
    assert r.status_code == 400 and "invalid reasoning value" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(daemon).responses.create(model="nope", input="hi")
