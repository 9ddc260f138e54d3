"""Ollama's native API: /api/generate, /api/chat, /api/embed, /api/embeddings.

Parse: the wire record (api.wire.native) into a pipeline request. Render: events
into NDJSON lines, or one object when `stream` is false.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

from corral.api.types import STREAM_CONTENT_TYPE as NDJSON, nanoseconds, rfc3339
from corral.api.wire import parse
from corral.api.wire.native import (ChatRequest, EmbeddingsRequest, EmbedRequest,
                                    Final, GenerateRequest, Generation)
from corral.api.wire.native import Message as WireMessage
from corral.errors import BadRequest, CorralError, Shape, format_error
from corral.server.chat.messages import Message, ToolCall, function_tool
from corral.server.http import Handler, Request
from corral.server.chat.models import require_model
from corral.server.pipeline.embed import embed as embed_inputs
from corral.server.pipeline.services import Services, keep_alive_of
from corral.server.pipeline.request import ChatTask, CompletionTask, Event, Finished
from corral.server.dialects.stream import generation
from corral.server.chat.reply import Kind, Piece



def _common(wire: Generation) -> dict[str, Any]:
    logprobs = None
    if wire.logprobs or wire.top_logprobs:
        logprobs = int(wire.top_logprobs or 0)
    return {"model": require_model(wire.model), "options": wire.options or {},
            "keep_alive": keep_alive_of(wire.keep_alive), "think": wire.think,
            "format": wire.format or None, "grammar": wire.grammar or _option_grammar(wire),
            "logprobs": logprobs, "truncate": wire.truncate, "shift": wire.shift}


def _option_grammar(wire: Generation) -> str | None:
    """Clients that send only known fields can put `grammar` among the options."""
    grammar = (wire.options or {}).get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise BadRequest("grammar must be a string")
    return grammar or None


def parse_generate(wire: GenerateRequest) -> CompletionTask:
    if wire.raw and (wire.template or wire.system or wire.context):
        raise BadRequest("raw mode does not support template, system, or context")
    return CompletionTask(**_common(wire), prompt=wire.prompt or "", suffix=wire.suffix or "",
                             raw=wire.raw, system=wire.system, template=wire.template,
                             context=list(wire.context or []), images=list(wire.images or []))


def _message(m: WireMessage) -> Message:
    calls = tuple(ToolCall(c.function.name, c.function.arguments, c.id or "")
                  for c in m.tool_calls or [])
    return Message(m.role, m.content or "", tuple(m.images or ()), m.thinking or "", calls,
                   m.tool_name or "", m.tool_call_id or "")


def parse_chat(wire: ChatRequest) -> ChatTask:
    return ChatTask(**_common(wire), messages=[_message(m) for m in wire.messages or []],
                    tools=[function_tool(t) for t in wire.tools or []])


class Lines:
    """NDJSON for /api/generate (`chat` false) and /api/chat (`chat` true)."""

    content_type = NDJSON

    def __init__(self, model: str, chat: bool, raw: bool = False) -> None:
        self.model, self.chat, self.raw = model, chat, raw

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": rfc3339(time.time())}

    def objects(self, events: Iterator[Event]) -> Iterator[dict[str, Any]]:
        for event in events:
            if isinstance(event, Finished):
                yield dict(self._final(event))
                continue
            out = {**self._head(), **self._body(event), "done": False}
            if event.logprobs:
                out["logprobs"] = [e.to_json() for e in event.logprobs]
            yield out

    def _body(self, piece: Piece) -> dict[str, Any]:
        if not self.chat:
            key = "thinking" if piece.kind is Kind.THINKING else "response"
            return {"response": "", key: piece.text}
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if piece.kind is Kind.CONTENT:
            message["content"] = piece.text
        elif piece.kind is Kind.THINKING:
            message["thinking"] = piece.text
        else:
            assert piece.call is not None
            message["tool_calls"] = [piece.call.native()]
        return {"message": message}

    def _final(self, final: Finished) -> Final:
        out: Final = {
            "model": self.model, "created_at": rfc3339(time.time()), "done": True,
            "done_reason": final.done_reason,
            "total_duration": nanoseconds(final.total_duration),
            "load_duration": nanoseconds(final.load_duration),
            "prompt_eval_count": final.prompt_eval_count,
            "prompt_eval_duration": final.prompt_eval_duration,
            "eval_count": final.eval_count, "eval_duration": final.eval_duration,
            # Corral's: speculative decoding's drafted tokens and the accepted ones (0 and
            # 0 when nothing was drafted); Ollama's clients ignore fields they do not know.
            "draft_count": final.draft_count,
            "draft_accepted_count": final.draft_accepted_count}
        if self.chat:
            out["message"] = {"role": "assistant", "content": ""}
        else:
            out["response"] = ""
            if not self.raw:
                out["context"] = list(final.context)
        return out

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        for obj in self.objects(events):
            yield json.dumps(obj, ensure_ascii=False).encode() + b"\n"

    def whole(self, events: Iterator[Event]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for obj in self.objects(events):
            for key, value in obj.items():
                if key in ("response", "thinking", "logprobs") and key in merged:
                    merged[key] += value
                elif key == "message" and "message" in merged:
                    _merge_message(merged["message"], value)
                else:
                    merged[key] = value
        return merged

    def error_frame(self, exc: CorralError) -> bytes:
        return json.dumps(format_error(exc, Shape.OLLAMA)[1]).encode() + b"\n"


def _merge_message(into: dict[str, Any], part: dict[str, Any]) -> None:
    into["content"] += part.get("content", "")
    if part.get("thinking"):
        into["thinking"] = into.get("thinking", "") + part["thinking"]
    if part.get("tool_calls"):
        into["tool_calls"] = into.get("tool_calls", []) + part["tool_calls"]


def _load_or_unload(handler: Handler, services: Services, wire: Generation, chat: bool) -> None:
    """A request with nothing to generate loads the model, or unloads it (keep_alive 0)."""
    view = services.models.view(wire.model)
    keep_alive = keep_alive_of(wire.keep_alive)
    base: dict[str, Any] = {"model": wire.model, "created_at": rfc3339(time.time())}
    base.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    if keep_alive == 0:
        services.scheduler.unload(view.record)
        handler.send_json(200, {**base, "done": True, "done_reason": "unload"})
        return
    services.scheduler.load(view.record, view.options(wire.options), keep_alive)
    handler.send_json(200, {**base, "done": True, "done_reason": "load"})


def generate(services: Services) -> Callable[[Request, Handler], None]:
    def idle(wire: GenerateRequest, request: CompletionTask, handler: Handler) -> bool:
        if request.prompt or request.suffix:
            return False
        _load_or_unload(handler, services, wire, chat=False)
        return True
    return generation(services, GenerateRequest, parse_generate,
                      lambda wire, request: Lines(request.model, chat=False, raw=request.raw),
                      idle)


def chat(services: Services) -> Callable[[Request, Handler], None]:
    def idle(wire: ChatRequest, request: ChatTask, handler: Handler) -> bool:
        if request.messages:
            return False
        _load_or_unload(handler, services, wire, chat=True)
        return True
    return generation(services, ChatRequest, parse_chat,
                      lambda wire, request: Lines(request.model, chat=True), idle)


def embed(services: Services) -> Callable[[Request, Handler], None]:
    def route(req: Request, handler: Handler) -> None:
        wire = parse(EmbedRequest, req.json())
        view = services.models.view(wire.model, 'model "{}" not found, try pulling it first')
        keep_alive = keep_alive_of(wire.keep_alive)
        inputs = [wire.input] if isinstance(wire.input, str) else wire.input
        if not inputs:
            services.scheduler.load(view.record, view.options(wire.options), keep_alive)
            handler.send_json(200, {"model": wire.model, "embeddings": []})
            return
        started = time.perf_counter()
        result, load = embed_inputs(services, view, inputs, wire.options, keep_alive,
                                    wire.truncate, normalize=True,
                                    dimensions=wire.dimensions or 0,
                                    on_disconnect=req.on_disconnect)
        handler.send_json(200, {"model": wire.model, "embeddings": result.embeddings,
                                "total_duration": nanoseconds(time.perf_counter() - started),
                                "load_duration": nanoseconds(load),
                                "prompt_eval_count": result.prompt_eval_count})
    return route


def embeddings(services: Services) -> Callable[[Request, Handler], None]:
    def route(req: Request, handler: Handler) -> None:
        wire = parse(EmbeddingsRequest, req.json())
        view = services.models.view(wire.model, 'model "{}" not found, try pulling it first')
        keep_alive = keep_alive_of(wire.keep_alive)
        if not wire.prompt:
            services.scheduler.load(view.record, view.options(wire.options), keep_alive)
            handler.send_json(200, {"embedding": []})
            return
        result, _ = embed_inputs(services, view, [wire.prompt], wire.options, keep_alive,
                                 normalize=False, on_disconnect=req.on_disconnect)
        handler.send_json(200, {"embedding": result.embeddings[0]})
    return route
