"""Ollama's native request records: /api/generate, /api/chat, /api/embed, /api/embeddings."""

from __future__ import annotations

from typing import Any, Literal, Optional, TypedDict, Union

from pydantic import Field

from corral.api.wire import Wire
from corral.api.wire.common import FunctionTool, KeepAlive, Options, Think, TopLogprobs

Format = Union[Literal["json", ""], dict[str, Any], None]


class Generation(Wire):
    """What /api/generate and /api/chat share."""

    model: Optional[str] = None
    think: Think = None
    format: Format = None
    grammar: Optional[str] = None  # a Corral extension: GBNF, as llama-server takes it
    options: Options = None
    keep_alive: KeepAlive = None
    stream: bool = True
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    truncate: bool = True
    shift: bool = True


class GenerateRequest(Generation):
    prompt: Optional[str] = None
    suffix: Optional[str] = None
    images: Optional[list[str]] = None
    raw: bool = False
    template: Optional[str] = None
    system: Optional[str] = None
    context: Optional[list[int]] = None


class ToolCallFunction(Wire):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: Optional[int] = None


class ToolCall(Wire):
    id: Optional[str] = None
    function: ToolCallFunction


class Message(Wire):
    role: str
    content: Optional[str] = None
    images: Optional[list[str]] = None
    tool_calls: Optional[list[ToolCall]] = None
    thinking: Optional[str] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None


class ChatRequest(Generation):
    messages: Optional[list[Message]] = None
    tools: Optional[list[FunctionTool]] = None


class EmbedRequest(Wire):
    model: Optional[str] = None
    input: Union[str, list[str], None] = None
    truncate: bool = True
    dimensions: Optional[int] = Field(default=None, ge=0)
    options: Options = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(Wire):
    model: Optional[str] = None
    prompt: Optional[str] = None
    options: Options = None
    keep_alive: KeepAlive = None


# Response records: built by the server, so typed for mypy rather than validated.

class Final(TypedDict, total=False):
    """The last line of /api/generate and /api/chat (and the whole answer, unstreamed)."""

    model: str
    created_at: str
    response: str  # generate
    thinking: str
    message: dict[str, Any]  # chat: role, content, thinking, tool_calls
    logprobs: list[dict[str, Any]]
    done: bool
    done_reason: str
    total_duration: int  # nanoseconds
    load_duration: int
    prompt_eval_count: int  # the tokens evaluated, as Ollama counts them
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int
    draft_count: int  # Corral's: tokens speculative decoding drafted (and verified)
    draft_accepted_count: int  # of which accepted
    context: list[int]  # generate, unless raw
