"""OpenAI's Responses API (/v1/responses) as pipeline requests, stateless as Ollama's is,
and as Codex speaks it.

`input` (a string, or message, function_call, function_call_output, custom_tool_call,
custom_tool_call_output and reasoning items) becomes chat messages; `instructions` and
`developer` messages system messages. A `namespace` tool's functions are shown to the
model by qualified name (`ns.name`), and a `custom` (freeform) tool as a function of
one string, `input`; the model's calls of either are mapped back to the client's
shape. Tools OpenAI's servers run (web_search and the like) are left out of the
model's list, and logged once. The reply is a list of output items in the order the
model wrote them: reasoning (its summary holds the thinking, as plain text: nothing is
encrypted, whatever `include` asks), message (output_text), function_call,
custom_tool_call. `store`, `prompt_cache_key` and `client_metadata` are taken and have
nothing to do: nothing is stored, and the prompt cache finds a conversation's prefix
by its tokens. Streamed, each item is added, takes
deltas and is done, between response.created and response.completed; every event
carries a sequence_number. llama-server's `timings`, with speculative decoding's counts,
are a field of the whole response, or, streamed, sit beside it on response.completed
(where llama-server puts them). `previous_response_id` needs stored responses, which a
stateless server does not keep: it is a 400.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from corral.api.wire import parse
from corral.api.wire.common import AudioPart
from corral.api.wire.responses import (AnyTool, Content, CustomCallItem, CustomTool,
                                       FunctionCallItem, FunctionChoice, MessageItem,
                                       NamespaceTool, ReasoningItem, Response,
                                       ResponsesRequest, TextPart, TimedResponse, Tool as Fn,
                                       Usage)
from corral.errors import BadRequest, CorralError
from corral.server.chat.messages import (EMPTY_SCHEMA, Message, Tool, ToolCall, placed_text,
                                         tool_named)
from corral.server.dialects.openai import structured, think_of_effort
from corral.server.http import Handler, Request
from corral.server.chat.images import from_data_uri
from corral.server.chat.models import require_model
from corral.server.pipeline.services import Services
from corral.server.pipeline.request import ChatTask, ChoiceMode, Event, Finished, ToolChoice
from corral.server.pipeline.count import count
from corral.server.pipeline.leftout import left_out
from corral.server.dialects.stream import SSE, generation
from corral.server.dialects.timings import timings
from corral.server.chat.reply import Kind, Piece

def _text(content: Content, images: list[str] | None = None) -> str:
    """A content's text; its input_image parts (data URIs) and input_audio parts go to
    `images` (Ollama's list for both) where allowed, each placed where its part stood."""
    if isinstance(content, str):
        return content
    parts: list[str | None] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append(part.text)
            continue
        if images is None:
            raise BadRequest(f"unsupported content part type {part.type!r}")
        if isinstance(part, AudioPart):
            images.append(part.input_audio.data)
        elif part.file_id:
            raise BadRequest("input_image file_id is not supported: send a data URI")
        else:
            images.append(from_data_uri(part.image_url))
        parts.append(None)
    return placed_text(parts)


def _messages(wire: ResponsesRequest) -> list[Message]:
    out: list[Message] = []
    if wire.instructions:
        out.append(Message("system", wire.instructions))
    if isinstance(wire.input, str):
        return out + [Message("user", wire.input)]
    thinking = ""
    for item in wire.input:
        if isinstance(item, ReasoningItem):
            thinking = "".join(s.text for s in item.summary)
            continue
        if isinstance(item, MessageItem):
            images: list[str] = []
            role = "system" if item.role == "developer" else item.role
            text = _text(item.content, images)
            out.append(Message(role, text, tuple(images)))
        elif isinstance(item, (FunctionCallItem, CustomCallItem)):
            _call(out, item)
        else:
            out.append(Message("tool", _text(item.output), tool_call_id=item.call_id,
                               tool_name=tool_named(out, item.call_id)))
        if thinking and out[-1].role == "assistant":
            out[-1], thinking = replace(out[-1], thinking=thinking), ""
    return out


def _call(out: list[Message], item: FunctionCallItem | CustomCallItem) -> None:
    """A call item joins the assistant message before it, or starts one; the model sees
    it by the name it was shown (a namespace's member qualified, a custom tool's input as
    its one argument)."""
    if isinstance(item, CustomCallItem):
        args: Any = {"input": item.input}
    else:
        try:
            args = json.loads(item.arguments or "{}")
        except ValueError:
            raise BadRequest("function_call arguments must be JSON") from None
        if not isinstance(args, dict | None):
            raise BadRequest("function_call arguments must be a JSON object")
    call = ToolCall(_qualified(item.namespace, item.name), args or {}, item.call_id)
    if out and out[-1].role == "assistant":
        out[-1] = replace(out[-1], tool_calls=out[-1].tool_calls + (call,))
    else:
        out.append(Message("assistant", tool_calls=(call,)))


def _format(wire: ResponsesRequest) -> Any:
    fmt = wire.text.format if wire.text is not None else None
    return structured(fmt.type if fmt else None, fmt.schema_ if fmt else None, "text.format")


# A freeform tool's one argument: the text the model writes for it.
FREEFORM = {"type": "object", "properties": {"input": {
    "type": "string", "description": "the tool's input, as plain text"}}, "required": ["input"]}


@dataclass(frozen=True)
class Shown:
    """What a tool the model was shown (by its qualified name) is to the client."""

    name: str
    namespace: str | None = None
    custom: bool = False


def _qualified(namespace: str | None, name: str) -> str:
    return f"{namespace}.{name}" if namespace and not name.startswith(namespace + ".") \
        else name


def expand_tools(tools: list[AnyTool]) -> dict[str, tuple[Tool, Shown]]:
    """The tools as the model sees them, each keyed by the name the model calls it."""
    out: dict[str, tuple[Tool, Shown]] = {}

    def add(tool: Fn | CustomTool, namespace: str | None) -> None:
        name = _qualified(namespace, tool.name)
        if isinstance(tool, CustomTool):
            out[name] = Tool(name, tool.description or "", dict(FREEFORM)), \
                Shown(tool.name, namespace, custom=True)
        else:
            out[name] = Tool(name, tool.description or "", tool.parameters
                             or dict(EMPTY_SCHEMA)), Shown(tool.name, namespace)

    for t in tools:
        if isinstance(t, NamespaceTool):
            for member in t.tools:
                add(member, t.name)
        elif isinstance(t, (Fn, CustomTool)):
            add(t, None)
        else:
            left_out(f"responses hosted tool {t.type}", "OpenAI's servers run it; Corral "
                     "runs no hosted tools, so the model is not shown it")
    return out


def parse_responses(wire: ResponsesRequest) -> ChatTask:
    if wire.previous_response_id:
        raise BadRequest("previous_response_id is not supported: responses are not stored "
                         "(send the whole conversation in input)")
    options: dict[str, Any] = {"temperature": 1.0 if wire.temperature is None
                               else wire.temperature}
    if wire.top_p is not None:
        options["top_p"] = wire.top_p
    if wire.max_output_tokens is not None:
        options["num_predict"] = wire.max_output_tokens
    choice = wire.tool_choice
    forced = ToolChoice(ChoiceMode.NAMED, choice.name) if isinstance(choice, FunctionChoice) \
        else ToolChoice(ChoiceMode(choice or "auto"))
    tools = [tool for tool, _ in expand_tools(wire.tools or []).values()]
    return ChatTask(model=require_model(wire.model), messages=_messages(wire),
                       options=options, format=_format(wire), grammar=wire.grammar or None,
                       think=think_of_effort(wire.reasoning.effort if wire.reasoning else None),
                       tools=tools, tool_choice=forced)


class Items:
    """Output items built from pieces; also the event sequence that streams them."""

    content_type = SSE

    def __init__(self, model: str, tool_choice: Any, tools: list[dict[str, Any]],
                 shown: dict[str, Shown] | None = None, parallel: bool = True) -> None:
        self.model, self.tool_choice, self.tools = model, tool_choice, tools
        self.shown, self.parallel = shown or {}, parallel
        self.id, self.created = "resp_" + secrets.token_hex(12), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item growing
        self.final = Finished()
        self.sent = 0  # events streamed, for sequence_number

    def response(self, status: str) -> Response:
        f = self.final
        usage: Usage = {"input_tokens": f.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": f.cached_tokens},
                        "output_tokens": f.eval_count,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": f.prompt_tokens + f.eval_count}
        text = "".join(p["text"] for i in self.output if i["type"] == "message"
                       for p in i["content"])
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": self.output,
                "output_text": text, "error": None, "incomplete_details": None,
                "parallel_tool_calls": self.parallel, "tool_choice": self.tool_choice or "auto",
                "tools": self.tools,
                "usage": usage if status == "completed" else None}

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """Take one piece; returns the events it makes (item events are keyed by index)."""
        events: list[tuple[str, dict[str, Any]]] = []
        kind = {Kind.THINKING: "reasoning", Kind.CONTENT: "message"}.get(piece.kind)
        if self.open is not None and self.open["type"] != kind:
            events += self._close()
        if piece.kind is Kind.CALL:
            return events + self._called(piece)
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

    def _called(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """A call as the client declared its tool: a function_call (with its namespace),
        or a custom tool's custom_tool_call with its text input."""
        call = piece.call
        assert call is not None
        shown = self.shown.get(call.name, Shown(call.name))
        kind, field = ("custom_tool_call", "input") if shown.custom else \
            ("function_call", "arguments")
        value = call.arguments.get("input") if shown.custom else None
        text = value if isinstance(value, str) else json.dumps(call.arguments)
        item = {"type": kind, "id": ("ctc_" if shown.custom else "fc_") + secrets.token_hex(8),
                "call_id": call.id, "name": shown.name, field: text, "status": "completed"}
        if shown.namespace:
            item["namespace"] = shown.namespace
        self.output.append(item)
        index = len(self.output) - 1
        delta = "response.custom_tool_call_input" if shown.custom else \
            "response.function_call_arguments"
        return [("response.output_item.added", {"output_index": index, "item": {
                    **item, field: "", "status": "in_progress"}}),
                (f"{delta}.delta", {"item_id": item["id"], "output_index": index,
                                    "delta": text}),
                (f"{delta}.done", {"item_id": item["id"], "output_index": index, field: text}),
                ("response.output_item.done", {"output_index": index, "item": item})]

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

    def events(self, events: Iterator[Event]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "response.created", {"response": self.response("in_progress")}
        yield "response.in_progress", {"response": self.response("in_progress")}
        for event in events:
            if isinstance(event, Finished):
                self.final = event
            else:
                yield from self.add(event)
        if self.open is not None:
            yield from self._close()
        yield "response.completed", {"response": self.response("completed"),
                                     "timings": timings([self.final])}  # llama-server's

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        for name, data in self.events(events):
            event = {"type": name, "sequence_number": self.sent, **data}
            self.sent += 1
            yield f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()

    def error_frame(self, exc: CorralError) -> bytes:
        """After response.created: the stream's own error event."""
        error = {"type": "error", "sequence_number": self.sent, "code": None,
                 "message": exc.message, "param": None}
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()

    def whole(self, events: Iterator[Event]) -> TimedResponse:
        for event in events:
            if isinstance(event, Finished):
                self.final = event
            else:
                self.add(event)
        return {**self.response("completed"), "timings": timings([self.final])}


def _items(wire: ResponsesRequest, request: ChatTask) -> Items:
    choice = wire.tool_choice.model_dump() if isinstance(wire.tool_choice, FunctionChoice) \
        else wire.tool_choice
    shown = {name: s for name, (_, s) in expand_tools(wire.tools or []).items()}
    return Items(request.model, choice, [t.model_dump(exclude_none=True, by_alias=True)
                                         for t in wire.tools or []], shown,
                 wire.parallel_tool_calls)


def responses(services: Services) -> Callable[[Request, Handler], None]:
    return generation(services, ResponsesRequest, parse_responses, _items)


def input_tokens(services: Services) -> Callable[[Request, Handler], None]:
    """POST /v1/responses/input_tokens: a Responses body -> the whole prompt the same
    request would evaluate from cold, instructions, tools and images included."""
    def route(req: Request, handler: Handler) -> None:
        request = parse_responses(parse(ResponsesRequest, req.json()))
        handler.send_json(200, {"object": "response.input_tokens",
                                "input_tokens": count(services, request)})
    return route
