"""Anthropic's Messages API (/v1/messages), on the same inference path as /api/chat.

Requests become Ollama-style chat messages: `system` (a string or text blocks) a system
message, `tool_use` blocks the assistant's tool calls (their ids kept), `tool_result`
blocks tool messages that name the call they answer, `thinking` blocks the assistant's
thinking. Replies are content blocks in the order the model wrote them; streamed, they
are Anthropic's server-sent events: message_start, content_block_start/delta/stop per
block, message_delta with the stop reason and usage, message_stop.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Iterator

from corral.errors import BadRequest, CorralError, Shape, format_error
from server.http import Handler, Request
from server.images import from_data_uri
from server.inference import Inference, Outcome, capabilities
from server.openai import shaped_route
from server.reply import Kind, Piece
from server.replies import check_think, pieces_of, raw_grammar

SSE = "text/event-stream"


anthropic_route = shaped_route(Shape.ANTHROPIC)


def _text_of(blocks: Any, what: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    if not isinstance(blocks, list):
        raise BadRequest(f"{what} must be a string or a list of content blocks")
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise BadRequest(f"{what} may only hold text blocks")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _image_of(source: Any) -> str:
    """An image block's base64 data; a URL source is refused (nothing is fetched)."""
    if not isinstance(source, dict):
        raise BadRequest("image block needs a source")
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return str(source["data"])
    if source.get("type") == "url":
        return from_data_uri(source.get("url"))  # only a data URI gets through
    raise BadRequest("image source must be base64 data")


def _blocks(role: str, content: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first, as Ollama orders them."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest("message content must be a string or a list of content blocks")
    text, thinking, calls, results, images = [], "", [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking = str(block.get("thinking", ""))
        elif kind == "tool_use":
            if not block.get("id") or not block.get("name"):
                raise BadRequest("tool_use block missing required 'id' or 'name' field")
            args = block.get("input") or {}
            if not isinstance(args, dict):
                raise BadRequest("tool_use input must be an object")
            calls.append({"id": str(block["id"]),
                          "function": {"name": str(block["name"]), "arguments": args}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text_of(block.get("content"), "tool_result content")})
        elif kind == "image":
            images.append(_image_of(block.get("source")))
        else:
            raise BadRequest(f"unsupported content block type {kind!r}")
    out = list(results)
    if text or calls or thinking or images:
        message: dict[str, Any] = {"role": role, "content": "".join(text)}
        if images:
            message["images"] = images
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["thinking"] = thinking
        out.append(message)
    return out


def _named(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results get the name of the call they answer, for templates that print it."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool":
            m["tool_name"] = names.get(m.get("tool_call_id", ""), "")
    return messages


def _request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any],
                                             list[dict[str, Any]], bool | str | None]:
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        raise BadRequest("max_tokens: field required (a positive integer)")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages: at least one message is required")
    messages = []
    system = _text_of(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest("messages: roles must be 'user' or 'assistant'")
        messages += _blocks(m["role"], m.get("content"))
    options: dict[str, Any] = {"num_predict": body["max_tokens"]}
    for key, option in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                        ("stop_sequences", "stop")):
        if body.get(key) is not None:
            options[option] = body[key]
    tools = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest("tools: each tool needs a name")
        tools.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}})
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    think: bool | str | None = {"enabled": True, "disabled": False}.get(str(kind))
    config = body.get("output_config")
    effort = str(config.get("effort") or "").lower() if isinstance(config, dict) else ""
    if think is None and effort in ("low", "medium", "high", "max", "xhigh"):
        think = "high" if effort in ("max", "xhigh") else effort
    return _named(messages), options, tools, think


def messages(inf: Inference) -> Any:
    @anthropic_route
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        chat, options, tools, think = _request(body)
        template = inf.template_text(record)
        caps = capabilities(inf.store, record, template)
        check_think(think, caps, body["model"])
        if tools and "tools" not in caps:
            raise BadRequest(f"{record.name.full()} does not support tools")
        outcome = Outcome()
        text = inf.generate(record, {"messages": inf.chat_messages(record, chat),
                                     "tools": tools or None, "think": think,
                                     "grammar": raw_grammar(body, inf.settings.max_grammar_bytes)},
                            inf.options(record, options), None, outcome, req.on_disconnect)
        pieces = pieces_of(text, outcome, template, think, tools)
        message = {"id": "msg_" + secrets.token_hex(12), "type": "message",
                   "role": "assistant", "model": body["model"]}
        if body.get("stream"):
            _stream(handler, Blocks(message, outcome).events(pieces))
        else:
            handler.send_json(200, Blocks(message, outcome).whole(pieces))
    return route


def _stop_reason(outcome: Outcome, called: bool) -> str:
    if called:
        return "tool_use"
    return "max_tokens" if outcome.stats.get("done_reason") == "length" else "end_turn"


class Blocks:
    """A reply's pieces as content blocks: thinking and text blocks grow while their
    kind of piece keeps coming; each call is a whole tool_use block."""

    def __init__(self, message: dict[str, Any], outcome: Outcome) -> None:
        self.message, self.outcome = message, outcome

    def whole(self, pieces: Iterator[Piece]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.kind is Kind.CALL:
                content.append(_tool_use(piece))
            elif content and content[-1]["type"] == _block_type(piece):
                content[-1][_field(piece)] += piece.text
            else:
                content.append(_opened(piece) | {_field(piece): piece.text})
        called = any(b["type"] == "tool_use" for b in content)
        return {**self.message, "content": content,
                "stop_reason": _stop_reason(self.outcome, called), "stop_sequence": None,
                "usage": self._usage()}

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": int(self.outcome.stats.get("prompt_eval_count", 0)),
                "output_tokens": int(self.outcome.stats.get("eval_count", 0))}

    def events(self, pieces: Iterator[Piece]) -> Iterator[tuple[str, dict[str, Any]]]:
        first = True
        index, open_type, called = -1, None, False
        for piece in pieces:
            if first:  # after the first piece: the prompt is counted, the model loaded
                yield "message_start", {"type": "message_start", "message": {
                    **self.message, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}
                first = False
            kind = _block_type(piece)
            if open_type is not None and (kind != open_type or piece.kind is Kind.CALL):
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
                open_type = None
            if piece.kind is Kind.CALL:
                index, called = index + 1, True
                block = _tool_use(piece)
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": {**block, "input": {}}}
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "input_json_delta",
                                                        "partial_json": json.dumps(block["input"])}}
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
                continue
            if open_type is None:
                index, open_type = index + 1, kind
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": _opened(piece)}
            delta = {"type": f"{_field(piece)}_delta", _field(piece): piece.text}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": delta}
        if first:
            yield "message_start", {"type": "message_start", "message": {
                **self.message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}}
        if open_type is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        yield "message_delta", {"type": "message_delta", "delta": {
            "stop_reason": _stop_reason(self.outcome, called), "stop_sequence": None},
            "usage": self._usage()}
        yield "message_stop", {"type": "message_stop"}


def _block_type(piece: Piece) -> str:
    return {Kind.THINKING: "thinking", Kind.CONTENT: "text", Kind.CALL: "tool_use"}[piece.kind]


def _field(piece: Piece) -> str:
    return "thinking" if piece.kind is Kind.THINKING else "text"


def _opened(piece: Piece) -> dict[str, Any]:
    if piece.kind is Kind.THINKING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _tool_use(piece: Piece) -> dict[str, Any]:
    assert piece.call is not None
    fn = piece.call["function"]
    return {"type": "tool_use", "id": "toolu_" + piece.call["id"].removeprefix("call_"),
            "name": fn["name"], "input": fn["arguments"]}


def _stream(handler: Handler, events: Iterator[tuple[str, dict[str, Any]]]) -> None:
    writer = None
    try:
        for name, data in events:
            if writer is None:  # errors before the first event still get a status
                writer = handler.start_stream(SSE)
            line = f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
            if not writer.write(line.encode()):
                return
    except CorralError as exc:
        if writer is None:
            raise
        error = format_error(exc, Shape.ANTHROPIC)[1]
        writer.write(f"event: error\ndata: {json.dumps(error)}\n\n".encode())
    if writer is not None:
        writer.end()
