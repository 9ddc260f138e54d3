"""Tool calls parsed from model output."""

from __future__ import annotations

from server.tools import call_id, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
         {"type": "function", "function": {"name": "add", "parameters": {}}}]


def test_plain_json_call() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert parse_tool_calls(text, TOOLS) == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def test_wrapped_list_and_parameters_key() -> None:
    text = ('<tool_call>[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
            '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]</tool_call>')
    calls = parse_tool_calls(text, TOOLS)
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert calls[1]["function"]["arguments"] == {"city": "Oslo"}


def test_unknown_tools_and_prose_are_not_calls() -> None:
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', TOOLS) == []
    assert parse_tool_calls("I think {the answer} is 4", TOOLS) == []
    assert parse_tool_calls('{"name": "add", "arguments": "not json"}', TOOLS) == []


def test_call_ids() -> None:
    cid = call_id()
    assert cid.startswith("call_") and len(cid) == 13 and cid[5:].isalnum()
