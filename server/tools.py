"""Tool calls parsed from model output, the way the model's template formats them."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from typing import Any, Iterable, Iterator


def _candidates(text: str) -> list[Any]:
    decoder = json.JSONDecoder()
    found, pos = [], 0
    while pos < len(text):
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        found.append(value)
        pos = end
    return found


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    inner = obj.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else obj
    name = fn.get("name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return {"function": {"name": name, "arguments": args}}


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every `{"name": ..., "arguments": {...}}` in the output naming a known tool."""
    names = {str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)}
    calls = []
    for value in _candidates(text):
        for item in value if isinstance(value, list) else [value]:
            call = _as_call(item, names)
            if call is not None:
                calls.append(call)
    return calls


def call_id() -> str:
    return "call_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict[str, Any]]  # Ollama's shape, each with an id


def with_tool_calls(pieces: Iterable[str], tools: list[dict[str, Any]]
                    ) -> Iterator[str | ToolCalls]:
    """Text pieces as they come; with tools, the whole reply is held and parsed first.

    A reply that holds calls yields one ToolCalls and no text; one that holds
    none yields its text as a single piece.
    """
    if not tools:
        yield from pieces
        return
    text = "".join(pieces)
    calls = parse_tool_calls(text, tools)
    if calls:
        yield ToolCalls([{"id": call_id(), **c} for c in calls])
    elif text:
        yield text
