"""OpenAI's Responses API (/v1/responses), stateless as Ollama's is.

`input` (a string, or message, function_call, function_call_output and reasoning
items) becomes chat messages; `instructions` a system message. The reply is a list
of output items in the order the model wrote them: reasoning (its summary holds the
thinking), message (output_text), function_call. Streamed, each item is added, takes
deltas and is done, between response.created and response.completed; every event
carries a sequence_number. `previous_response_id` needs stored responses, which a
stateless server does not keep: it is a 400.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterator

from corral.errors import BadRequest, CorralError
from server.http import Handler, Request
from server.images import from_data_uri
from server.inference import Inference, Outcome, capabilities, grammar_for
from server.openai import openai_route
from server.reply import Kind, Piece
from server.replies import check_think, pieces_of, raw_grammar


def _text(content: Any, images: list[str] | None = None) -> str:
    """A content's text; its input_image parts (data URIs) go to `images` where allowed."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append(str(part.get("text", "")))
        elif kind == "input_image" and images is not None:
            if part.get("file_id"):
                raise BadRequest("input_image file_id is not supported: send a data URI")
            images.append(from_data_uri(part.get("image_url")))
        else:
            raise BadRequest(f"unsupported content part type {kind!r}")
    return "".join(parts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items")
    thinking = ""
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("input items must be objects")
        kind = item.get("type") or ("message" if item.get("role") else None)
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("user", "assistant", "system"):
                raise BadRequest("message role must be user, assistant, system or developer")
            images: list[str] = []
            message = {"role": role, "content": _text(item.get("content", ""), images)}
            out.append({**message, "images": images} if images else message)
        elif kind == "reasoning":
            thinking = "".join(str(s.get("text", "")) for s in item.get("summary") or []
                               if isinstance(s, dict))
            continue
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise BadRequest("function_call arguments must be JSON") from None
            call = {"id": str(item.get("call_id", "")),
                    "function": {"name": str(item.get("name", "")), "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = str(item.get("call_id", ""))
            out.append({"role": "tool", "tool_call_id": call_id, "tool_name": _name(out, call_id),
                        "content": _text(item.get("output", ""))})
        else:
            raise BadRequest(f"unknown input item type: {kind!r}")
        if thinking and out[-1]["role"] == "assistant":
            out[-1]["thinking"], thinking = thinking, ""
    return out


def _name(earlier: list[dict[str, Any]], call_id: str) -> str:
    for m in reversed(earlier):
        for call in m.get("tool_calls") or []:
            if call["id"] == call_id:
                return str(call["function"]["name"])
    return ""


def _settings(body: dict[str, Any]) -> tuple[dict[str, Any], bool | str | None, list[Any]]:
    if body.get("previous_response_id"):
        raise BadRequest("previous_response_id is not supported: responses are not stored "
                         "(send the whole conversation in input)")
    options: dict[str, Any] = {"temperature": body.get("temperature", 1.0)}
    if body.get("top_p") is not None:
        options["top_p"] = body["top_p"]
    if body.get("max_output_tokens") is not None:
        options["num_predict"] = body["max_output_tokens"]
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(
        body.get("reasoning"), dict) else None
    if effort not in (None, "", "none", "low", "medium", "high"):
        raise BadRequest(f'invalid reasoning value: "{effort}" (must be "high", "medium", '
                         '"low", or "none")')
    think: bool | str | None = None if not effort else False if effort == "none" else effort
    tools = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
            raise BadRequest("only function tools with a name are supported")
        tools.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
    return options, think, tools


def _format(body: dict[str, Any]) -> Any:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return fmt.get("schema")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return "json"
    return None


def responses(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        messages = _messages(body)
        options, think, tools = _settings(body)
        template = inf.template_text(record)
        check_think(think, capabilities(inf.store, record, template), body["model"])
        limit = inf.settings.max_grammar_bytes
        outcome = Outcome()
        text = inf.generate(record, {
            "messages": inf.chat_messages(record, messages), "tools": tools or None,
            "think": think, "grammar": raw_grammar(body, limit, _format(body)) or
            grammar_for(_format(body), limit)}, inf.options(record, options), None, outcome,
            req.on_disconnect)
        items = Items(body["model"], outcome)
        pieces = pieces_of(text, outcome, template, think, tools)
        if body.get("stream"):
            _stream(handler, items.events(pieces))
        else:
            for piece in pieces:
                items.add(piece)
            handler.send_json(200, items.response("completed"))
    return route


class Items:
    """Output items built from pieces; also the event sequence that streams them."""

    def __init__(self, model: str, outcome: Outcome) -> None:
        self.model, self.outcome = model, outcome
        self.id, self.created = "resp_" + secrets.token_hex(12), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item growing

    def response(self, status: str) -> dict[str, Any]:
        s = self.outcome.stats
        usage = {"input_tokens": int(s.get("prompt_eval_count", 0)),
                 "output_tokens": int(s.get("eval_count", 0))}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        text = "".join(p["text"] for i in self.output if i["type"] == "message"
                       for p in i["content"])
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": self.output,
                "output_text": text, "error": None, "incomplete_details": None,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": usage if status == "completed" else None}

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """Take one piece; returns the events it makes (item events are keyed by index)."""
        events: list[tuple[str, dict[str, Any]]] = []
        kind = {Kind.THINKING: "reasoning", Kind.CONTENT: "message"}.get(piece.kind)
        if self.open is not None and self.open["type"] != kind:
            events += self._close()
        if piece.kind is Kind.CALL:
            assert piece.call is not None
            fn = piece.call["function"]
            item = {"type": "function_call", "id": "fc_" + secrets.token_hex(8),
                    "call_id": piece.call["id"], "name": fn["name"],
                    "arguments": json.dumps(fn["arguments"]), "status": "completed"}
            self.output.append(item)
            index = len(self.output) - 1
            events += [("response.output_item.added", {"output_index": index, "item": {
                           **item, "arguments": "", "status": "in_progress"}}),
                       ("response.function_call_arguments.delta", {
                           "item_id": item["id"], "output_index": index,
                           "delta": item["arguments"]}),
                       ("response.function_call_arguments.done", {
                           "item_id": item["id"], "output_index": index,
                           "arguments": item["arguments"]}),
                       ("response.output_item.done", {"output_index": index, "item": item})]
            return events
        if self.open is None:
            events += self._opened(kind or "message")
        assert self.open is not None
        index = len(self.output) - 1
        if kind == "reasoning":
            self.open["summary"][0]["text"] += piece.text
            events.append(("response.reasoning_summary_text.delta", {
                "item_id": self.open["id"], "output_index": index, "summary_index": 0,
                "delta": piece.text}))
        else:
            self.open["content"][0]["text"] += piece.text
            events.append(("response.output_text.delta", {
                "item_id": self.open["id"], "output_index": index, "content_index": 0,
                "delta": piece.text, "logprobs": []}))
        return events

    def _opened(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        index = len(self.output)
        part: dict[str, Any]
        if kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            self.open = {"type": "reasoning", "id": "rs_" + secrets.token_hex(8),
                         "summary": [part]}
            self.output.append(self.open)
            return [("response.output_item.added", {"output_index": index, "item": {
                        **self.open, "summary": []}}),
                    ("response.reasoning_summary_part.added", {
                        "item_id": self.open["id"], "output_index": index, "summary_index": 0,
                        "part": dict(part)})]
        part = {"type": "output_text", "text": "", "annotations": []}
        self.open = {"type": "message", "id": "msg_" + secrets.token_hex(8),
                     "status": "completed", "role": "assistant", "content": [part]}
        self.output.append(self.open)
        return [("response.output_item.added", {"output_index": index, "item": {
                    **self.open, "status": "in_progress", "content": []}}),
                ("response.content_part.added", {
                    "item_id": self.open["id"], "output_index": index, "content_index": 0,
                    "part": dict(part)})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        assert item is not None
        index = self.output.index(item)
        if item["type"] == "reasoning":
            part = item["summary"][0]
            return [("response.reasoning_summary_text.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "text": part["text"]}),
                    ("response.reasoning_summary_part.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "part": part}),
                    ("response.output_item.done", {"output_index": index, "item": item})]
        part = item["content"][0]
        return [("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                               "content_index": 0, "text": part["text"],
                                               "logprobs": []}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                "content_index": 0, "part": part}),
                ("response.output_item.done", {"output_index": index, "item": item})]

    def events(self, pieces: Iterator[Piece]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "response.created", {"response": self.response("in_progress")}
        yield "response.in_progress", {"response": self.response("in_progress")}
        for piece in pieces:
            yield from self.add(piece)
        if self.open is not None:
            yield from self._close()
        yield "response.completed", {"response": self.response("completed")}


def _stream(handler: Handler, events: Iterator[tuple[str, dict[str, Any]]]) -> None:
    from server.openai import SSE

    writer = handler.start_stream(SSE)
    n = 0
    try:
        for n, (name, data) in enumerate(events):
            event = {"type": name, "sequence_number": n, **data}
            if not writer.write(f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()):
                return
    except CorralError as exc:  # after response.created: the stream's own error event
        error = {"type": "error", "sequence_number": n + 1, "code": None,
                 "message": exc.message, "param": None}
        writer.write(f"event: error\ndata: {json.dumps(error)}\n\n".encode())
    writer.end()
