"""OpenAI's request records: /v1/chat/completions, /v1/completions, /v1/embeddings."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict, Union

from pydantic import Field

from corral.api.wire import Wire
from corral.api.wire.common import (AudioPart, ChatToolChoice, Choices, FunctionTool, Timings,
                                    TopLogprobs)

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Unit = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Positive = Annotated[int, Field(ge=1)]
Stop = Union[str, list[str], None]


class StreamOptions(Wire):
    include_usage: bool = False


class Sampling(Wire):
    """What chat and legacy completions share."""

    model: Optional[str] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[Unit] = None
    max_tokens: Optional[Positive] = None
    seed: Optional[int] = None
    frequency_penalty: Optional[Penalty] = None
    presence_penalty: Optional[Penalty] = None
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Choices = 1
    ignore_eos: Optional[bool] = None  # llama-server's extension, for benchmarks
    grammar: Optional[str] = None  # a Corral extension: GBNF
    options: Optional[dict[str, Any]] = None  # where clients that send only known fields put it


class ImageURL(Wire):
    url: str


class TextPart(Wire):
    type: Literal["text"]
    text: str


class ImagePart(Wire):
    type: Literal["image_url"]
    image_url: Union[str, ImageURL]


Part = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class CallFunction(Wire):
    name: str
    arguments: str = "{}"


class Call(Wire):
    id: str = ""
    type: Literal["function"] = "function"
    function: CallFunction


class Message(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Part], None] = None
    tool_calls: Optional[list[Call]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None
    reasoning: Optional[str] = None


class JSONSchemaFormat(Wire):
    name: str = ""
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class Effort(Wire):
    effort: Optional[str] = None


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Optional[Positive] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: ChatToolChoice = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[str] = None
    reasoning: Optional[Effort] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None


class CompletionRequest(Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=1)]]
    suffix: Optional[str] = None
    logprobs: Optional[TopLogprobs] = None  # legacy: the alternatives wanted per token


class EmbeddingRequest(Wire):
    model: Optional[str] = None
    input: Union[str, Annotated[list[str], Field(min_length=1)]]
    encoding_format: Literal["float", "base64", "FLOAT", "BASE64"] = "float"
    dimensions: Optional[Positive] = None
    truncate: bool = True  # Ollama's: false makes an input over the context a 400


# Response records: built by the server, so typed for mypy rather than validated.

class CachedTokens(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int  # the whole prompt
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens  # the part of the prompt reused from the KV cache


class ChatChoice(TypedDict):
    index: int
    message: dict[str, Any]
    finish_reason: str
    logprobs: Optional[dict[str, Any]]


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings  # llama-server's, beside usage (api.wire.common)


class TextChoice(TypedDict):
    text: str
    index: int
    finish_reason: str
    logprobs: Optional[dict[str, Any]]


class TextCompletion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage
    timings: Timings  # llama-server's, beside usage (api.wire.common)
