"""The reply parser alone: thinking, content and calls from text cut at every point."""

from __future__ import annotations

import random
from typing import Any

import pytest

from corral.server.chat.reply import Format, Kind, Piece, ReplyParser, call_id, reply_format

THINK = Format(think=("<think>", "</think>"))
TAGS = Format(tools="tags")
TOOLS = {"get_weather", "add"}


def run(fmt: Format, text: str, cuts: list[int], **kw: Any) -> list[Piece]:
    parser = ReplyParser(fmt, TOOLS, **kw)
    out: list[Piece] = []
    last = 0
    for cut in sorted(cuts) + [len(text)]:
        out += parser.feed(text[last:cut])
        last = cut
    return out + parser.finish()


def merged(pieces: list[Piece]) -> list[tuple[str, Any]]:
    """Adjacent text of one kind joined; calls by name and arguments (ids are random)."""
    out: list[tuple[str, Any]] = []
    for p in pieces:
        if p.kind is Kind.CALL:
            assert p.call is not None
            out.append(("call", (p.call.name, p.call.arguments, p.call.index)))
        elif out and out[-1][0] == p.kind.value:
            out[-1] = (p.kind.value, out[-1][1] + p.text)
        else:
            out.append((p.kind.value, p.text))
    return out


def every_split(fmt: Format, text: str, **kw: Any) -> list[tuple[str, Any]]:
    """The same result however the text is cut into pieces (one char, random, whole)."""
    whole = merged(run(fmt, text, [], **kw))
    assert merged(run(fmt, text, list(range(1, len(text))), **kw)) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = rng.sample(range(1, max(len(text), 2)), min(3, max(len(text) - 1, 0)))
        assert merged(run(fmt, text, cuts, **kw)) == whole
    return whole


@pytest.mark.parametrize("text,expected", [
    ("<think>plan it</think>The answer.", [("thinking", "plan it"), ("content", "The answer.")]),
    ("  <think>\nx</think>\n\nA", [("thinking", "x"), ("content", "A")]),
    ("No thoughts here", [("content", "No thoughts here")]),
    ("<thinking is not a tag", [("content", "<thinking is not a tag")]),
    ("<think>cut off", [("thinking", "cut off")]),
    ("<think>a < b </thin k></think>ok", [("thinking", "a < b </thin k>"), ("content", "ok")]),
])
def test_think_tags(text: str, expected: list[tuple[str, str]]) -> None:
    assert every_split(THINK, text) == expected


def test_thinking_already_open_from_the_prompt() -> None:
    got = every_split(THINK, "still thinking</think>Done", thinking_open=True)
    assert got == [("thinking", "still thinking"), ("content", "Done")]


def test_content_before_a_call_streams_before_it_completes() -> None:
    parser = ReplyParser(TAGS, TOOLS)
    first = parser.feed("Let me check. <tool_c")
    assert [p.text for p in first] == ["Let me check. "]  # the tag prefix is held, not lost
    assert parser.feed('all>{"name": "get_weather", "arguments": {"city": "Paris"}') == []
    [call] = parser.feed("}</tool_call>")
    assert call.kind is Kind.CALL and call.call is not None
    assert call.call.native()["function"] == {"index": 0, "name": "get_weather",
                                              "arguments": {"city": "Paris"}}
    assert call.call.id.startswith("call_")


@pytest.mark.parametrize("fmt,text,expected", [
    (TAGS, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
           '</tool_call>',
     [("call", ("add", {"a": 1}, 0)), ("call", ("get_weather", {"city": "Oslo"}, 1))]),
    (TAGS, "<tool_call>not json</tool_call> after",
     [("content", "<tool_call>not json</tool_call> after")]),
    (TAGS, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     [("content", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')]),
    (TAGS, '<tool_call>{"name": "add"', [("content", '<tool_call>{"name": "add"')]),
    (Format(tools="mistral"), 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]',
     [("content", "Sure."), ("call", ("add", {"a": 2}, 0))]),
    (Format(tools="json"), ' {"name": "add", "parameters": {"a": 3}}',
     [("call", ("add", {"a": 3}, 0))]),
    (Format(tools="json"), '<|python_tag|>{"name": "add", "parameters": {"a": 4}}',
     [("call", ("add", {"a": 4}, 0))]),
    (Format(tools="json"), "Plain answer {not a call}", [("content", "Plain answer {not a call}")]),
    (Format(tools="json"), "[1, 2, 3] are numbers", [("content", "[1, 2, 3] are numbers")]),
    (Format(think=("<think>", "</think>"), tools="tags"),
     '<think>need weather</think>Checking.<tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Rome"}}</tool_call>',
     [("thinking", "need weather"), ("content", "Checking."),
      ("call", ("get_weather", {"city": "Rome"}, 0))]),
])
def test_tool_call_formats(fmt: Format, text: str, expected: list[Any]) -> None:
    assert every_split(fmt, text) == expected


@pytest.mark.parametrize("text,expected", [
    ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello!<|return|>", [("thinking", "Think first."), ("content", "Hello!")]),
    ("<|channel|>analysis<|message|>Weather?<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     [("thinking", "Weather?"), ("call", ("get_weather", {"city": "Paris"}, 0))]),
    ("<|channel|>commentary to=functions.get_weather<|message|>{broken<|call|>",
     [("content", "{broken")]),
    ("plain text", [("content", "plain text")]),
])
def test_harmony(text: str, expected: list[Any]) -> None:
    assert every_split(Format(tools="harmony", harmony=True), text) == expected


def test_formats_come_from_the_template() -> None:
    assert reply_format("{{ .Think }}<think>", True, False).think == ("<think>", "</think>")
    assert reply_format("<think>", False, False).think is None
    assert reply_format("<tool_call>{{ .Tools }}", False, True).tools == "tags"
    assert reply_format("[TOOL_CALLS] {{ .Tools }}", False, True).tools == "mistral"
    assert reply_format("{{ .Tools }}", False, True).tools == "json"
    assert reply_format("<|channel|>", True, True).harmony


def test_call_ids() -> None:
    cid = call_id()
    assert cid.startswith("call_") and len(cid) == 13 and cid[5:].isalnum()


# Ollama's behaviour where it and the earlier parser differed (its tools parser tests).
@pytest.mark.parametrize("fmt,text,expected", [
    # A JSON object that does not open the reply is text: only a call may open it.
    (Format(tools="json"), '{"name": "jeff"}{"name": "get_weather", "arguments": {"a": 1}}',
     [("content", '{"name": "jeff"}{"name": "get_weather", "arguments": {"a": 1}}')]),
    (Format(tools="json"), 'Sure: {"name": "add", "parameters": {"a": 1}}',
     [("content", 'Sure: {"name": "add", "parameters": {"a": 1}}')]),
    # A complete last call whose closing tag never came (the model stopped at EOS).
    (TAGS, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"location": "Tokyo"}}',
     [("call", ("add", {"a": 1}, 0)), ("call", ("get_weather", {"location": "Tokyo"}, 1))]),
    (TAGS, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n',
     [("call", ("add", {"a": 1}, 0))]),
    # Mistral's closing tag closes the list; it is no content.
    (Format(tools="mistral"), '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}][/TOOL_CALLS]',
     [("call", ("add", {"a": 1}, 0)), ("call", ("get_weather", {"city": "Oslo"}, 1))]),
    (Format(tools="mistral"), '[TOOL_CALLS][{"name": "add", "arguments": {}}] [/TOOL_C',
     [("call", ("add", {}, 0)), ("content", " [/TOOL_C")]),
])
def test_edge_cases_follow_ollama(fmt: Format, text: str, expected: list[Any]) -> None:
    assert every_split(fmt, text) == expected


def test_an_unclosed_call_of_no_known_tool_is_text_once() -> None:
    text = '<tool_call>{"name": "nope", "arguments": {}}'
    assert every_split(TAGS, text) == [("content", text)]
    # A list that turns out to be text takes no call index from the call after it.
    parser = ReplyParser(TAGS, TOOLS)
    later = parser.feed('<tool_call>[{"name": "add", "arguments": {}}, {"name": "x"}]'
                        '</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert [p.call.index for p in later if p.call] == [0]
