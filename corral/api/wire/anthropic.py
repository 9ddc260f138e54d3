"""Anthropic's Messages API request record (/v1/messages)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict, Union

from pydantic import Field

from corral.api.wire import Wire

Unit = Annotated[float, Field(ge=0.0, le=1.0)]


class TextBlock(Wire):
    type: Literal["text"]
    text: str


class Base64Source(Wire):
    type: Literal["base64"]
    data: str
    media_type: Optional[str] = None


class URLSource(Wire):
    type: Literal["url"]
    url: str  # only a data URI is taken: nothing is fetched


class ImageBlock(Wire):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]


class ThinkingBlock(Wire):
    type: Literal["thinking"]
    thinking: str = ""
    signature: Optional[str] = None


class ToolUseBlock(Wire):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any] = Field(default_factory=dict)


class RedactedThinkingBlock(Wire):
    """Thinking Anthropic encrypted: no model here can read it, so it is left out."""

    type: Literal["redacted_thinking"]
    data: str = ""


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(Wire):
    type: Literal["tool_result"]
    tool_use_id: str = ""
    content: Union[str, list[ResultPart], None] = None  # an image: a tool that read one
    is_error: bool = False


# The kinds Corral takes; any other `type` is a 400 that lists these.
Block = Annotated[Union[TextBlock, ImageBlock, ThinkingBlock, RedactedThinkingBlock,
                        ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(Wire):
    # Claude Code puts `system` turns among the messages (reminders mid-conversation);
    # Ollama takes them there too.
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class Tool(Wire):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                  "properties": {}})
    # A server tool names its kind and version ("web_search_20250305"): Anthropic runs
    # those itself, so Corral leaves them out of the model's list (server.dialects).
    type: Optional[str] = None
    defer_loading: bool = False  # found through a tool search, not listed up front


class AutoChoice(Wire):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnyChoice(Wire):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoice(Wire):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class NoneChoice(Wire):
    type: Literal["none"]


Choice = Annotated[Union[AutoChoice, AnyChoice, ToolChoice, NoneChoice],
                   Field(discriminator="type")]


class Thinking(Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=0)
    display: Optional[Literal["summarized", "omitted"]] = None  # omitted: blocks, no text


class KeepTurns(Wire):
    type: Literal["thinking_turns"]
    value: Annotated[int, Field(ge=0)]


class Edit(Wire):
    """One of `context_management.edits`: Corral applies clear_thinking's; any other kind
    is taken and left unapplied (docs/agents.md says why)."""

    type: str
    keep: Union[Literal["all"], KeepTurns, dict[str, Any], None] = None


class ContextManagement(Wire):
    edits: list[Edit] = Field(default_factory=list)


class OutputConfig(Wire):
    effort: Optional[Literal["low", "medium", "high", "max", "xhigh"]] = None


class MessagesRequest(Wire):
    model: Optional[str] = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    temperature: Optional[Unit] = None
    top_p: Optional[Unit] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Choice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    context_management: Optional[ContextManagement] = None
    grammar: Optional[str] = None  # a Corral extension: GBNF


# Response records: built by the server, so typed for mypy rather than validated.

class Usage(TypedDict):
    input_tokens: int  # evaluated: Anthropic counts cache reads apart
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    output_tokens: int


class MessageResponse(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str
    stop_sequence: Optional[str]
    usage: Usage
