"""Anthropic's Messages API (/v1/messages) as pipeline requests, as Claude Code speaks it.

Requests become Ollama-style chat messages: `system` (a string or text blocks) a system
message, and so is a `system` turn among the messages; `tool_use` blocks the assistant's
tool calls (their ids kept), `tool_result` blocks tool messages that name the call they
answer (with any image the tool read), `thinking` blocks the assistant's thinking.
`tool_choice` maps onto the pipeline's: `any` is a required call, `tool` a named one.
Server tools (a `type` such as web_search_20250305: Anthropic runs them) and tools
deferred to a tool search are left out of the model's list. `thinking` asked of a model
that cannot think is dropped on this route, as Ollama's does, and `clear_thinking` edits
of `context_management` are applied (docs/agents.md lists what else is taken as is).

Replies are content blocks in the order the model wrote them; streamed, they are
Anthropic's server-sent events: message_start as soon as the request is admitted, `ping`
while nothing else is said (a long prefill), content_block_start/delta/stop per
block, message_delta with the stop reason and usage, message_stop. With thinking's
`display: omitted`, thinking blocks come without their text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from typing import Any, Callable, Iterator

from corral.api.wire import parse
from corral.api.wire.anthropic import (AnyChoice, Block, Choice, ContextManagement,
                                       ImageBlock, KeepTurns, MessageResponse, MessagesRequest,
                                       NoneChoice, RedactedThinkingBlock, ResultPart, TextBlock,
                                       ThinkingBlock, Tool as WireTool, ToolChoice,
                                       ToolResultBlock, ToolUseBlock, URLSource, Usage)
from corral.errors import CorralError, Shape, format_error
from corral.server.chat.messages import Message, Tool, ToolCall, placed_text, tool_named
from corral.server.http import Handler, Request
from corral.server.chat.images import from_data_uri
from corral.server.chat.models import require_model
from corral.server.pipeline.services import Services
from corral.server.pipeline.request import (ChatTask, ChoiceMode, Event, Finished,
                                            ToolChoice as Forced)
from corral.server.pipeline.count import count
from corral.server.pipeline.leftout import left_out
from corral.server.dialects.stream import SSE, Idle, generation
from corral.server.chat.reply import Kind, Piece

KEEPALIVE = 5.0  # seconds of silence before a `ping`, as Anthropic's stream sends them


def _text_of(blocks: str | list[TextBlock] | list[ResultPart] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(block.text for block in blocks if isinstance(block, TextBlock))


def _images_of(blocks: str | list[ResultPart] | None) -> tuple[str, ...]:
    if blocks is None or isinstance(blocks, str):
        return ()
    return tuple(_image_of(b) for b in blocks if isinstance(b, ImageBlock))


def _image_of(block: ImageBlock) -> str:
    """An image block's base64 data; a URL source is refused (nothing is fetched)."""
    if isinstance(block.source, URLSource):
        return from_data_uri(block.source.url)  # only a data URI gets through
    return block.source.data


def _blocks(role: str, content: str | list[Block],
            earlier: list[Message]) -> list[Message]:
    """One Anthropic message as chat messages: tool results first, as Ollama orders them,
    each with the name of the call it answers (from `earlier`), for templates that
    print it; text and images in the order the blocks came."""
    if isinstance(content, str):
        return [Message(role, content)]
    parts: list[str | None] = []  # None: an image, in its place
    thinking, images = "", []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for block in content:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking = block.thinking
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(block.name, block.input, block.id))
        elif isinstance(block, ToolResultBlock):
            results.append(Message("tool", _text_of(block.content), _images_of(block.content),
                                   tool_name=tool_named(earlier, block.tool_use_id),
                                   tool_call_id=block.tool_use_id))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            images.append(_image_of(block))
            parts.append(None)
    out = list(results)
    if parts or calls or thinking:
        out.append(Message(role, placed_text(parts), tuple(images), thinking, tuple(calls)))
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
    return ChatTask(model=require_model(wire.model),
                    messages=_managed(messages, wire.context_management),
                    options=options, think=_think(wire), think_optional=True,
                    grammar=wire.grammar or None, tools=_tools(wire.tools or []),
                    tool_choice=_tool_choice(wire.tool_choice))


def _tools(tools: list[WireTool]) -> list[Tool]:
    """The tools the model is shown: a client's own (`custom`, or no type), listed up
    front. Server tools are Anthropic's to run, and a deferred tool waits for a tool
    search that only Anthropic's API performs."""
    out = []
    for t in tools:
        if t.type not in (None, "custom"):
            left_out(f"anthropic server tool {t.type}", "Anthropic runs server tools "
                     "itself; a local model is not shown them")
        elif t.defer_loading:
            left_out("anthropic deferred tools", "a deferred tool is loaded by "
                     "Anthropic's tool search, which Corral does not run")
        else:
            out.append(Tool(t.name, t.description, t.input_schema))
    return out


def _managed(messages: list[Message], management: ContextManagement | None) -> list[Message]:
    """`context_management`'s clear_thinking edits, applied: the thinking of all but the
    kept latest assistant turns is cleared. Other edits are taken and not applied."""
    for edit in management.edits if management is not None else []:
        if edit.type.startswith("clear_thinking_"):
            keep = edit.keep.value if isinstance(edit.keep, KeepTurns) else None
            if keep is None:
                continue  # "all" (Claude Code's), or nothing said: every turn keeps it
            turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
            cleared = set(turns[:max(len(turns) - keep, 0)])
            messages = [replace(m, thinking="") if i in cleared else m
                        for i, m in enumerate(messages)]
        else:
            left_out(f"context_management edit {edit.type}", "Corral keeps the whole "
                     "conversation in its prompt cache; only clear_thinking edits apply")
    return messages


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
    kind of piece keeps coming; each call is a whole tool_use block. `omit_thinking`
    keeps thinking blocks and drops their text (thinking's `display: omitted`)."""

    content_type = SSE

    def __init__(self, model: str, omit_thinking: bool = False,
                 keepalive: float = KEEPALIVE) -> None:
        self.id, self.model = "msg_" + secrets.token_hex(12), model
        self.message = {"id": self.id, "type": "message", "role": "assistant", "model": model}
        self.omit_thinking, self.keepalive = omit_thinking, keepalive

    def _text(self, piece: Piece) -> str:
        return "" if self.omit_thinking and piece.kind is Kind.THINKING else piece.text

    def whole(self, events: Iterator[Event]) -> MessageResponse:
        content: list[dict[str, Any]] = []
        final = Finished()
        for event in events:
            if isinstance(event, Finished):
                final = event
            elif event.kind is Kind.CALL:
                content.append(_tool_use(event))
            elif content and content[-1]["type"] == _block_type(event):
                content[-1][_field(event)] += self._text(event)
            else:
                content.append(_opened(event) | {_field(event): self._text(event)})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": _stop_reason(final), "stop_sequence": None,
                "usage": _usage(final)}

    def frames(self, events: Iterator[Event | Idle]) -> Iterator[bytes]:
        for name, data in self.events(events):
            yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def error_frame(self, exc: CorralError) -> bytes:
        error = format_error(exc, Shape.ANTHROPIC)[1]
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()

    def events(self, events: Iterator[Event | Idle]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "message_start", {"type": "message_start", "message": {
            **self.message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}
        index, open_type, final = -1, None, Finished()
        for event in events:
            if isinstance(event, Idle):
                yield "ping", {"type": "ping"}
                continue
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
            if self._text(event):
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": f"{_field(event)}_delta",
                                                        _field(event): self._text(event)}}
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


def _blocks_of(wire: MessagesRequest, request: ChatTask) -> Blocks:
    return Blocks(request.model, omit_thinking=wire.thinking is not None
                  and wire.thinking.display == "omitted")


def messages(services: Services) -> Callable[[Request, Handler], None]:
    return generation(services, MessagesRequest, parse_messages, _blocks_of)


def count_tokens(services: Services) -> Callable[[Request, Handler], None]:
    """POST /v1/messages/count_tokens: a Messages body (max_tokens may be left out: it
    changes no prompt) -> {"input_tokens"}, the whole prompt the same request would
    evaluate from cold, template, system, tools and images included (pipeline/count.py)."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(MessagesRequest, {"max_tokens": 1, **req.json()})
        handler.send_json(200, {"input_tokens": count(services, parse_messages(wire))})
    return route
