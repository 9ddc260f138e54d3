"""Anthropic's Messages API (/v1/messages) as pipeline requests.

Requests become Ollama-style chat messages: `system` (a string or text blocks) a system
message, `tool_use` blocks the assistant's tool calls (their ids kept), `tool_result`
blocks tool messages that name the call they answer, `thinking` blocks the assistant's
thinking. `tool_choice` maps onto the pipeline's: `any` is a required call, `tool` a
named one. Replies are content blocks in the order the model wrote them; streamed, they
are Anthropic's server-sent events: message_start, content_block_start/delta/stop per
block, message_delta with the stop reason and usage, message_stop.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable, Iterator

from corral.api.wire import parse
from corral.api.wire.anthropic import (AnyChoice, Block, Choice, ImageBlock, MessageResponse,
                                       MessagesRequest, NoneChoice, TextBlock, ThinkingBlock,
                                       ToolChoice, ToolResultBlock, ToolUseBlock, URLSource,
                                       Usage)
from corral.errors import CorralError, Shape, format_error
from corral.server.chat.messages import Message, Tool, ToolCall, tool_named
from corral.server.http import Handler, Request
from corral.server.chat.images import from_data_uri
from corral.server.chat.models import require_model
from corral.server.pipeline.services import Services
from corral.server.pipeline.request import (ChatTask, ChoiceMode, Event, Finished,
                                            ToolChoice as Forced)
from corral.server.pipeline.count import count
from corral.server.dialects.stream import SSE, generation
from corral.server.chat.reply import Kind, Piece

def _text_of(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(block.text for block in blocks)


def _image_of(block: ImageBlock) -> str:
    """An image block's base64 data; a URL source is refused (nothing is fetched)."""
    if isinstance(block.source, URLSource):
        return from_data_uri(block.source.url)  # only a data URI gets through
    return block.source.data


def _blocks(role: str, content: str | list[Block],
            earlier: list[Message]) -> list[Message]:
    """One Anthropic message as chat messages: tool results first, as Ollama orders them,
    each with the name of the call it answers (from `earlier`), for templates that
    print it."""
    if isinstance(content, str):
        return [Message(role, content)]
    text, thinking, images = [], "", []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for block in content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking = block.thinking
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(block.name, block.input, block.id))
        elif isinstance(block, ToolResultBlock):
            results.append(Message("tool", _text_of(block.content),
                                   tool_name=tool_named(earlier, block.tool_use_id),
                                   tool_call_id=block.tool_use_id))
        else:
            images.append(_image_of(block))
    out = list(results)
    if text or calls or thinking or images:
        out.append(Message(role, "".join(text), tuple(images), thinking, tuple(calls)))
    return out


def _tool_choice(choice: Choice | None) -> Forced:
    if isinstance(choice, AnyChoice):
        return Forced(ChoiceMode.REQUIRED)
    if isinstance(choice, ToolChoice):
        return Forced(ChoiceMode.NAMED, choice.name)
    if isinstance(choice, NoneChoice):
        return Forced(ChoiceMode.NONE)
    return Forced()


def _think(wire: MessagesRequest) -> bool | str | None:
    if wire.thinking is not None and wire.thinking.type != "adaptive":
        return wire.thinking.type == "enabled"
    effort = wire.output_config.effort if wire.output_config is not None else None
    if effort is None:
        return None  # adaptive, or nothing said: the model's own default
    return "high" if effort in ("max", "xhigh") else effort


def parse_messages(wire: MessagesRequest) -> ChatTask:
    messages: list[Message] = []
    system = _text_of(wire.system)
    if system:
        messages.append(Message("system", system))
    for m in wire.messages:
        messages += _blocks(m.role, m.content, messages)
    options: dict[str, Any] = {"num_predict": wire.max_tokens}
    for option, value in (("temperature", wire.temperature), ("top_p", wire.top_p),
                          ("top_k", wire.top_k), ("stop", wire.stop_sequences)):
        if value is not None:
            options[option] = value
    tools = [Tool(t.name, t.description, t.input_schema) for t in wire.tools or []]
    return ChatTask(model=require_model(wire.model), messages=messages,
                    options=options, think=_think(wire), grammar=wire.grammar or None,
                    tools=tools, tool_choice=_tool_choice(wire.tool_choice))


def _stop_reason(final: Finished) -> str:
    if final.called:
        return "tool_use"
    return "max_tokens" if final.done_reason == "length" else "end_turn"


def _usage(final: Finished) -> Usage:
    """Anthropic counts cache reads apart: input_tokens are the ones evaluated."""
    return {"input_tokens": final.prompt_tokens - final.cached_tokens,
            "cache_read_input_tokens": final.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": final.eval_count}


class Blocks:
    """A reply's pieces as content blocks: thinking and text blocks grow while their
    kind of piece keeps coming; each call is a whole tool_use block."""

    content_type = SSE

    def __init__(self, model: str) -> None:
        self.id, self.model = "msg_" + secrets.token_hex(12), model
        self.message = {"id": self.id, "type": "message", "role": "assistant", "model": model}

    def whole(self, events: Iterator[Event]) -> MessageResponse:
        content: list[dict[str, Any]] = []
        final = Finished()
        for event in events:
            if isinstance(event, Finished):
                final = event
            elif event.kind is Kind.CALL:
                content.append(_tool_use(event))
            elif content and content[-1]["type"] == _block_type(event):
                content[-1][_field(event)] += event.text
            else:
                content.append(_opened(event) | {_field(event): event.text})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": _stop_reason(final), "stop_sequence": None,
                "usage": _usage(final)}

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        for name, data in self.events(events):
            yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def error_frame(self, exc: CorralError) -> bytes:
        error = format_error(exc, Shape.ANTHROPIC)[1]
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()

    def events(self, events: Iterator[Event]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "message_start", {"type": "message_start", "message": {
            **self.message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}
        index, open_type, final = -1, None, Finished()
        for event in events:
            if isinstance(event, Finished):
                final = event
                continue
            kind = _block_type(event)
            if open_type is not None and (kind != open_type or event.kind is Kind.CALL):
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
                open_type = None
            index += 1 if open_type is None else 0
            if event.kind is Kind.CALL:
                yield from _tool_use_events(event, index)
                continue
            if open_type is None:
                open_type = kind
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": _opened(event)}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": f"{_field(event)}_delta",
                                                    _field(event): event.text}}
        if open_type is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        yield "message_delta", {"type": "message_delta", "delta": {
            "stop_reason": _stop_reason(final), "stop_sequence": None}, "usage": _usage(final)}
        yield "message_stop", {"type": "message_stop"}


def _tool_use_events(piece: Piece, index: int) -> Iterator[tuple[str, dict[str, Any]]]:
    block = _tool_use(piece)
    yield "content_block_start", {"type": "content_block_start", "index": index,
                                  "content_block": {**block, "input": {}}}
    yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                  "delta": {"type": "input_json_delta",
                                            "partial_json": json.dumps(block["input"])}}
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def _block_type(piece: Piece) -> str:
    return {Kind.THINKING: "thinking", Kind.CONTENT: "text", Kind.CALL: "tool_use"}[piece.kind]


def _field(piece: Piece) -> str:
    return "thinking" if piece.kind is Kind.THINKING else "text"


def _opened(piece: Piece) -> dict[str, Any]:
    if piece.kind is Kind.THINKING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _tool_use(piece: Piece) -> dict[str, Any]:
    call = piece.call
    assert call is not None
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


def messages(services: Services) -> Callable[[Request, Handler], None]:
    return generation(services, MessagesRequest, parse_messages,
                      lambda wire, request: Blocks(request.model))


def count_tokens(services: Services) -> Callable[[Request, Handler], None]:
    """POST /v1/messages/count_tokens: a Messages body (max_tokens may be left out: it
    changes no prompt) -> {"input_tokens"}, the whole prompt the same request would
    evaluate from cold, template, system, tools and images included (pipeline/count.py)."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(MessagesRequest, {"max_tokens": 1, **req.json()})
        handler.send_json(200, {"input_tokens": count(services, parse_messages(wire))})
    return route
