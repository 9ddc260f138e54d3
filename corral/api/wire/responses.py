"""OpenAI's Responses API request record (/v1/responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict, Union

from pydantic import Discriminator, Field, Tag

from corral.api.wire import Wire
from corral.api.wire.common import AudioPart, Timings

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Unit = Annotated[float, Field(ge=0.0, le=1.0)]


class Tool(Wire):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class CustomTool(Wire):
    """A freeform tool: the model writes its input as plain text (Codex's apply_patch)."""

    type: Literal["custom"]
    name: str
    description: Optional[str] = None


class NamespaceTool(Wire):
    """A named group of functions; the model calls them by qualified name, `ns.name`."""

    type: Literal["namespace"]
    name: str
    description: Optional[str] = None
    tools: list[Annotated[Union[Tool, CustomTool], Field(discriminator="type")]] = \
        Field(default_factory=list)


class HostedTool(Wire):
    """A tool OpenAI's servers run (web_search, file_search, code_interpreter, mcp...):
    Corral runs none of them, so it leaves them out of the model's list."""

    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


AnyTool = Annotated[Union[Annotated[Tool, Tag("function")],
                          Annotated[CustomTool, Tag("custom")],
                          Annotated[NamespaceTool, Tag("namespace")],
                          Annotated[HostedTool, Tag("hosted")]], Discriminator(_tool_kind)]


class FunctionChoice(Wire):
    type: Literal["function"]
    name: str


class TextFormat(Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class Text(Wire):
    format: Optional[TextFormat] = None


class Reasoning(Wire):
    effort: Optional[str] = None  # checked with the chat API's words, one message for both
    summary: Optional[str] = None


class TextPart(Wire):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(Wire):
    type: Literal["input_image"]
    image_url: Optional[str] = None  # a data URI: nothing is fetched
    file_id: Optional[str] = None
    detail: Optional[str] = None


Part = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]
Content = Union[str, list[Part]]


class MessageItem(Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content = ""


class SummaryText(Wire):
    type: Literal["summary_text"] = "summary_text"
    text: str = ""


class ReasoningItem(Wire):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)


class FunctionCallItem(Wire):
    type: Literal["function_call"]
    call_id: str = ""
    name: str = ""
    arguments: str = "{}"  # JSON text, as the API sends it
    namespace: Optional[str] = None  # a namespace tool's member


class FunctionCallOutputItem(Wire):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = ""
    output: Content = ""


class CustomCallItem(Wire):
    type: Literal["custom_tool_call"]
    call_id: str = ""
    name: str = ""
    input: str = ""
    namespace: Optional[str] = None


def _item_kind(value: Any) -> Optional[str]:
    # An item without a type but with a role is a message (the API's "easy" input form).
    if isinstance(value, dict):
        return value.get("type") or ("message" if value.get("role") else None)
    return getattr(value, "type", None)


Item = Annotated[Union[Annotated[MessageItem, Tag("message")],
                       Annotated[ReasoningItem, Tag("reasoning")],
                       Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                       Annotated[FunctionCallOutputItem, Tag("custom_tool_call_output")],
                       Annotated[CustomCallItem, Tag("custom_tool_call")]],
                 Discriminator(_item_kind, custom_error_type="invalid_union_member",
                               custom_error_message="unknown input item type (message, "
                               "reasoning, function_call, function_call_output, "
                               "custom_tool_call or custom_tool_call_output)")]


class ResponsesRequest(Wire):
    model: Optional[str] = None
    input: Union[str, Annotated[list[Item], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[Unit] = None
    stream: bool = False
    tools: Optional[list[AnyTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice, None] = None
    text: Optional[Text] = None
    reasoning: Optional[Reasoning] = None
    previous_response_id: Optional[str] = None
    # Taken and echoed: calls are parsed as the model writes them, one or several.
    parallel_tool_calls: bool = True
    grammar: Optional[str] = None  # a Corral extension: GBNF


# Response records: built by the server, so typed for mypy rather than validated.

class InputDetails(TypedDict):
    cached_tokens: int


class OutputDetails(TypedDict):
    reasoning_tokens: int


class Usage(TypedDict):
    input_tokens: int  # the whole prompt
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class Response(TypedDict):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    output_text: str
    error: None
    incomplete_details: None
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    usage: Optional[Usage]


class TimedResponse(Response):
    """A whole (unstreamed) response, with llama-server's `timings` beside usage (a
    streamed one puts them on its response.completed event, as llama-server does)."""

    timings: Timings
