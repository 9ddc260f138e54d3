"""Chat messages and tools as the request path carries them, whichever API they came in.

Each dialect turns its own blocks and items into these records; the pipeline checks
them; the prompt builder shows them to the model's template in the shape templates
read (Ollama's message, which Jinja chat templates read too). Only the JSON documents a
client wrote stay JSON: a tool's parameter schema and a call's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic comes with the HTTP stack, after the first runner starts
    from corral.api.wire.common import FunctionTool

Json = dict[str, Any]  # a JSON object a client or a model wrote (a schema, arguments)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Json = field(default_factory=dict)
    id: str = ""
    index: int = 0  # a call the model made: its place among the reply's calls

    def shown(self) -> Json:
        call: Json = {"function": {"name": self.name, "arguments": self.arguments}}
        return {"id": self.id, **call} if self.id else call

    def native(self) -> Json:
        """A call the model made, as Ollama's /api/chat writes it."""
        return {"id": self.id, "function": {"index": self.index, "name": self.name,
                                            "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    images: tuple[str, ...] = ()  # base64, checked at the edge
    thinking: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_name: str = ""  # a tool result: the tool that made it
    tool_call_id: str = ""  # a tool result: the call it answers

    @classmethod
    def of(cls, raw: Json) -> Message:
        """From Ollama's JSON shape (a Modelfile's MESSAGE layer, a test's literal)."""
        calls = tuple(ToolCall(str(c["function"]["name"]), dict(c["function"].get("arguments")
                                                               or {}), str(c.get("id") or ""))
                      for c in raw.get("tool_calls") or ())
        return cls(str(raw.get("role", "")), str(raw.get("content") or ""),
                   tuple(raw.get("images") or ()), str(raw.get("thinking") or ""), calls,
                   str(raw.get("tool_name") or ""), str(raw.get("tool_call_id") or ""))

    def with_content(self, content: str) -> Message:
        return replace(self, content=content)

    def shown(self) -> Json:
        """As templates read it: Ollama's message, with the fields it leaves out unset."""
        out: Json = {"role": self.role, "content": self.content}
        for name, value in (("images", list(self.images)), ("thinking", self.thinking),
                            ("tool_calls", [c.shown() for c in self.tool_calls]),
                            ("tool_name", self.tool_name), ("tool_call_id", self.tool_call_id)):
            if value:
                out[name] = value
        return out


def tool_named(messages: list[Message], call_id: str) -> str:
    """The tool a `tool_call_id` answers, from the assistant turn that made the call."""
    for m in reversed(messages):
        for call in m.tool_calls:
            if call_id and call.id == call_id:
                return call.name
    return ""


EMPTY_SCHEMA: Json = {"type": "object", "properties": {}}

# Where a media item's part stood in a message whose content came as parts (OpenAI's,
# Anthropic's, the Responses API's): the prompt puts the item there (chat.prompt), not in
# front as Ollama's `images` field places them. No client's text can hold it: it is taken
# out of every text part.
MEDIA_PLACE = "\x00corral-media\x00"


def placed_text(parts: list[str | None]) -> str:
    """Content parts as one text, each media item (None) where its part stood, joined as
    llama-server joins them: a text part after a text part on a new line, nothing
    around a media item."""
    out, after_media = "", False
    for part in parts:
        if part is None:
            out += MEDIA_PLACE
        else:
            out += ("\n" if out and not after_media else "") + part.replace(MEDIA_PLACE, "")
        after_media = part is None
    return out


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: Json = field(default_factory=lambda: dict(EMPTY_SCHEMA))  # JSON Schema

    def shown(self) -> Json:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def function_tool(t: FunctionTool) -> Tool:
    """Ollama's and OpenAI chat's {"type": "function", "function": {...}}."""
    return Tool(t.function.name, t.function.description, t.function.parameters)
