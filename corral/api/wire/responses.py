"""OpenAI's Responses API request record (/v1/responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict, Union

from pydantic import Field

from corral.api.wire import Wire

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Unit = Annotated[float, Field(ge=0.0, le=1.0)]


class Tool(Wire):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


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


class ResponsesRequest(Wire):
    model: Optional[str] = None
    # Items stay objects here: the dialect reads each type and refuses unknown ones by name.
    input: Union[str, Annotated[list[dict[str, Any]], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[Unit] = None
    stream: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice, None] = None
    text: Optional[Text] = None
    reasoning: Optional[Reasoning] = None
    previous_response_id: Optional[str] = None
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
