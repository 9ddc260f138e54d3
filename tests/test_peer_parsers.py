"""Ollama's thinking-parser cases (tests/peers/SOURCES.md) through Corral's reply parser:
the same input, fed in the same steps, gives the same thinking and content per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from corral.server.chat.reply import Format, Kind, Piece, ReplyParser

CASES = json.loads((Path(__file__).parent / "peers" / "ollama" / "thinking" /
                    "parser_cases.json").read_text())
THINK = Format(think=("<think>", "</think>"))


def texts(pieces: list[Piece]) -> tuple[str, str]:
    return ("".join(p.text for p in pieces if p.kind is Kind.THINKING),
            "".join(p.text for p in pieces if p.kind is Kind.CONTENT))


def test_all_thirteen_cases_are_here() -> None:
    assert len(CASES["extract"]) + len(CASES["streaming"]) == 13


@pytest.mark.parametrize("case", CASES["extract"], ids=lambda c: c["in"][:30])
def test_extract(case: dict[str, Any]) -> None:
    parser = ReplyParser(THINK)
    assert texts(parser.feed(case["in"]) + parser.finish()) == (case["thinking"],
                                                                 case["content"])


@pytest.mark.parametrize("case", CASES["streaming"], ids=lambda c: c["desc"])
def test_streaming(case: dict[str, Any]) -> None:
    if case["skip"]:
        pytest.skip("skipped in Ollama's own suite")
    parser = ReplyParser(THINK)
    for step in case["steps"]:
        assert texts(parser.feed(step["input"])) == (step["thinking"], step["content"]), step


TOOLS = json.loads((Path(__file__).parent / "peers" / "ollama" / "tools" /
                    "parser_cases.json").read_text())
# Ollama's test templates, by the call format Corral reads from each.
FORMATS = {"qwen": Format(tools="tags"), "json": Format(tools="json"),
           "list": Format(tools="json"), "mistral": Format(tools="mistral")}


def test_the_tools_cases_are_here() -> None:
    assert len(TOOLS["cases"]) == 30 and len(TOOLS["left_out"]) == 2  # DeepSeek's format


@pytest.mark.parametrize("case", TOOLS["cases"], ids=lambda c: f"{c['template']}-{c['name']}")
def test_tool_calls(case: dict[str, Any]) -> None:
    """Ollama feeds the inputs and reads what came out, with no end-of-reply flush."""
    parser = ReplyParser(FORMATS[case["template"]], set(TOOLS["tools"]))
    pieces = [p for text in case["inputs"] for p in parser.feed(text)]
    assert texts(pieces)[1] == case["content"]
    assert [{"name": p.call.name, "arguments": p.call.arguments}
            for p in pieces if p.kind is Kind.CALL and p.call is not None] == case["calls"]
