"""Preparing a request is a pure function of the request and its model's view: no store,
no scheduler, no model file. These build views by hand and check the plans."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from corral.config import load_settings
from corral.errors import BadRequest
from corral.options import Options
from corral.registry.models import ModelRecord
from corral.registry.names import parse_name
from corral.server.chat.messages import Message, Tool
from corral.server.chat.models import ModelView, capabilities
from corral.server.pipeline.prepare import prepare
from corral.server.pipeline.request import (ChatTask, ChoiceMode, CompletionTask,
                                            ToolChoice)

SETTINGS = load_settings({}, warn=False)
CHATML_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>")
THINKING = "{{ if .Think }}<think>{{ end }}{{ .Prompt }}"
TOOL = Tool("get_weather")


def msgs(*raw: dict[str, Any]) -> list[Message]:
    return [Message.of(m) for m in raw]


def view(template: str = "", *, vision: bool = False, embedding: bool = False,
         parameters: dict[str, Any] | None = None, system: str | None = None,
         messages: list[dict[str, Any]] | None = None) -> ModelView:
    # The paths name nothing on disk: a plan never opens them.
    record = ModelRecord(name=parse_name("m"), digest="0" * 64, size=0, modified_at=0.0,
                         model_path=Path("/nonexistent/model.gguf"), model_digest="1" * 64,
                         template=template or None, system=system,
                         parameters=parameters or {}, messages=messages or [])
    return ModelView(record, template, None, embedding, vision,
                     capabilities(template, embedding, vision),
                     Options.parse(parameters))


def png(width: int = 2, height: int = 2) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    rows = b"".join(b"\x00" + b"\x00\x00\x00" * width for _ in range(height))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                              0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return base64.b64encode(data).decode()


def test_capabilities_follow_the_weights_and_the_template() -> None:
    assert capabilities("", embedding=False, vision=False) == ("completion",)
    assert capabilities("", embedding=True, vision=False) == ("embedding",)
    assert capabilities(CHATML_TOOLS, False, True) == ("completion", "tools", "vision")
    assert capabilities(THINKING, False, False) == ("completion", "thinking")
    assert "insert" in capabilities("{{ .Prompt }}{{ .Suffix }}", False, False)
    # A template that only mentions the word in its text claims no tools.
    assert "tools" not in capabilities("You have no tools.", False, False)


def test_options_merge_defaults_then_the_model_then_the_request() -> None:
    v = view(parameters={"temperature": 0.2, "top_p": 0.9})
    plan = prepare(v, CompletionTask(model="m", prompt="hi",
                                        options={"temperature": 0}), SETTINGS)
    assert plan.options.temperature == 0 and plan.options.top_p == 0.9
    assert v.defaults.temperature == 0.2  # the shared view is never changed
    with pytest.raises(AttributeError):
        v.defaults.temperature = 1  # type: ignore[misc]


def test_the_same_request_and_view_give_the_same_plan() -> None:
    v = view(CHATML_TOOLS)
    request = ChatTask(model="m", messages=msgs({"role": "user", "content": "hi"}),
                       tools=[TOOL])
    assert prepare(v, request, SETTINGS) == prepare(v, request, SETTINGS)


@pytest.mark.parametrize("template,request_,message", [
    ("", CompletionTask(model="m", prompt="x", think=True), "does not support thinking"),
    ("", ChatTask(model="m", messages=[], tools=[TOOL]), "does not support tools"),
    ("", CompletionTask(model="m", prompt="x", suffix="y"), "does not support insert"),
    ("", CompletionTask(model="m", prompt="x", images=[png()]), "does not support vision"),
    (CHATML_TOOLS, ChatTask(model="m", messages=[],
                               tool_choice=ToolChoice(ChoiceMode.REQUIRED)), "needs tools"),
    (CHATML_TOOLS, ChatTask(model="m", messages=[], tools=[TOOL], format="json",
                               tool_choice=ToolChoice(ChoiceMode.REQUIRED)),
     "cannot be given with a format"),
    ("", CompletionTask(model="m", prompt="x", format="json", grammar="root ::= \"a\""),
     "either a format or a grammar"),
    ("", CompletionTask(model="m", prompt="x", grammar="root ::= " + "(" * 300 + "\"a\""
                           + ")" * 300), "nests parentheses"),
    ("", ChatTask(model="m", messages=msgs({"role": "robot", "content": "x"})),
     "invalid message role"),
])
def test_what_the_view_cannot_do_is_a_400(template: str, request_: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        prepare(view(template), request_, SETTINGS)


def test_thinking_models_think_unless_told_not_to() -> None:
    v = view(THINKING)
    assert prepare(v, CompletionTask(model="m", prompt="x"), SETTINGS).think is True
    assert prepare(v, CompletionTask(model="m", prompt="x", think=False),
                   SETTINGS).think is False
    assert prepare(view(), CompletionTask(model="m", prompt="x"), SETTINGS).think is None


def test_tool_choice_none_leaves_the_tools_out() -> None:
    v = view(CHATML_TOOLS)
    messages = msgs({"role": "user", "content": "hi"})
    auto = prepare(v, ChatTask(model="m", messages=messages, tools=[TOOL]), SETTINGS)
    assert auto.tool_names == {"get_weather"} and auto.fmt.tools is not None
    none = prepare(v, ChatTask(model="m", messages=messages, tools=[TOOL],
                                  tool_choice=ToolChoice(ChoiceMode.NONE)), SETTINGS)
    assert none.tools == [] and none.fmt.tools is None


def test_messages_follow_the_models_own_system_and_messages() -> None:
    v = view(CHATML_TOOLS, system="Be brief.",
             messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    plan = prepare(v, ChatTask(model="m", messages=msgs({"role": "USER", "content": "c"})),
                   SETTINGS)
    assert [(m.role, m.content) for m in plan.messages] == [
        ("system", "Be brief."), ("user", "a"), ("assistant", "b"), ("user", "c")]
    # A request that opens with its own system message replaces the model's SYSTEM.
    own = prepare(view(CHATML_TOOLS, system="Be brief."),
                  ChatTask(model="m", messages=msgs({"role": "system", "content": "Mine."})),
                  SETTINGS)
    assert [m.content for m in own.messages] == ["Mine."]


def test_images_are_checked_against_the_limits() -> None:
    v = view(vision=True)
    plan = prepare(v, CompletionTask(model="m", prompt="x", images=[png()]), SETTINGS)
    assert plan.images == [png()]
    few = load_settings({"CORRAL_MAX_IMAGES": "1"}, warn=False)
    chat = ChatTask(model="m", messages=msgs({"role": "user", "content": "x",
                                              "images": [png(), png()]}))
    with pytest.raises(BadRequest, match="CORRAL_MAX_IMAGES"):
        prepare(v, chat, few)
    with pytest.raises(BadRequest, match="image 0"):
        prepare(v, CompletionTask(model="m", prompt="x", images=["not base64!"]), SETTINGS)


def test_a_grammar_and_a_format_are_checked_before_any_load() -> None:
    small = load_settings({"CORRAL_MAX_GRAMMAR_BYTES": "64"}, warn=False)
    with pytest.raises(BadRequest, match="CORRAL_MAX_GRAMMAR_BYTES"):
        prepare(view(), CompletionTask(model="m", prompt="x", grammar="root ::= " + "\"a\" "
                                          * 40), small)
    plan = prepare(view(), CompletionTask(model="m", prompt="x", format="json"), SETTINGS)
    assert plan.grammar is not None and "root" in plan.grammar


def test_a_request_template_gives_another_view() -> None:
    plain = view()
    own = plain.with_template(THINKING)
    assert "thinking" in own.capabilities and "thinking" not in plain.capabilities
    assert own.record is plain.record and plain.with_template(None) is plain
