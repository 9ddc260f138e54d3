"""The Anthropic stream as Claude Code waits on it, and context_management's edits: pure
parts, with a generation that the test holds and releases."""

from __future__ import annotations

import json
import threading
from typing import Iterator

from corral.api.wire import parse
from corral.api.wire.anthropic import MessagesRequest
from corral.server.chat.reply import Kind, Piece
from corral.server.dialects.anthropic import Blocks, parse_messages
from corral.server.dialects.stream import Event, Idle, Live, with_idle
from corral.server.pipeline.request import Finished

DEADLINE = 30.0


def held(live: Live, release: threading.Event, closed: threading.Event) -> Iterator[Event]:
    """A generation admitted at once, which says nothing until `release`: a long
    prefill."""
    try:
        live.admit()
        assert release.wait(DEADLINE)
        yield Piece(Kind.CONTENT, "Hi")
        yield Finished(prompt_tokens=3, eval_count=1)
    finally:
        closed.set()


def test_message_start_at_once_then_pings_until_the_first_token() -> None:
    release, closed, live = threading.Event(), threading.Event(), Live(0.01)
    frames = Blocks("m").frames(with_idle(held(live, release, closed), live))
    names = []
    for frame in frames:
        names.append(frame.decode().split("\n")[0].removeprefix("event: "))
        if names.count("ping") == 3:
            release.set()  # the first token comes only once pings have gone out
    assert names[0] == "message_start" and names[1:4] == ["ping"] * 3
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in names and closed.wait(DEADLINE)


def test_a_reader_that_leaves_closes_the_generation() -> None:
    release, closed, live = threading.Event(), threading.Event(), Live(0.01)
    marked = with_idle(held(live, release, closed), live)
    assert isinstance(next(marked), Idle)  # the admission
    marked.close()  # the client left while nothing had come
    release.set()
    assert closed.wait(DEADLINE)  # its holds are given back on the generation's thread


def test_an_error_before_the_admission_comes_first() -> None:
    """A full queue or a load that fails raises before anything is yielded: the route
    answers it with a status, not a stream."""
    def failing() -> Iterator[Event]:
        raise ValueError("no model")
        yield  # pragma: no cover

    marked = with_idle(failing(), Live(DEADLINE))
    try:
        next(marked)
    except ValueError as exc:
        assert str(exc) == "no model"
    else:
        raise AssertionError("the generation's error was lost")


def request(**extra: object) -> MessagesRequest:
    turns = [{"role": "user", "content": "a"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1"},
                                               {"type": "text", "text": "b"}]},
             {"role": "user", "content": "c"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "t2"},
                                               {"type": "redacted_thinking", "data": "x"},
                                               {"type": "text", "text": "d"}]},
             {"role": "system", "content": "Be brief."},
             {"role": "user", "content": "e"}]
    return parse(MessagesRequest, {"model": "m", "max_tokens": 5, "messages": turns, **extra})


def test_clear_thinking_keeps_the_latest_turns() -> None:
    def thoughts(**extra: object) -> list[str]:
        task = parse_messages(request(**extra))
        return [m.thinking for m in task.messages if m.role == "assistant"]

    assert thoughts() == ["t1", "t2"]
    edit = {"type": "clear_thinking_20251015"}
    assert thoughts(context_management={"edits": [{**edit, "keep": "all"}]}) == ["t1", "t2"]
    keep_one = {**edit, "keep": {"type": "thinking_turns", "value": 1}}
    assert thoughts(context_management={"edits": [keep_one]}) == ["", "t2"]
    keep_none = {**edit, "keep": {"type": "thinking_turns", "value": 0}}
    other = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                             "value": 1000}}
    assert thoughts(context_management={"edits": [keep_none, other]}) == ["", ""]
    roles = [m.role for m in parse_messages(request()).messages]
    assert roles == ["user", "assistant", "user", "assistant", "system", "user"]


def test_omitted_thinking_keeps_its_block() -> None:
    pieces: list[Event] = [Piece(Kind.THINKING, "hmm"), Piece(Kind.CONTENT, "Hi"), Finished()]
    whole = Blocks("m", omit_thinking=True).whole(iter(pieces))
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in whole["content"]] == [
        ("thinking", ""), ("text", "Hi")]
    frames = [json.loads(f.decode().split("data: ")[1]) for f in
              Blocks("m", omit_thinking=True).frames(iter(pieces))]
    assert [f["delta"]["type"] for f in frames if f["type"] == "content_block_delta"] == [
        "text_delta"]
