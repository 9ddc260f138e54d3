"""Ollama's native generation routes: /api/generate, /api/chat, /api/embed(dings)."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from api.types import STREAM_CONTENT_TYPE, nanoseconds, rfc3339
from corral.errors import BadRequest, CorralError, format_error
from registry.models import ModelRecord
from server.http import Handler, Request
from server.inference import (
    Inference,
    Outcome,
    capabilities,
    grammar_for,
    keep_alive_of,
)
from server.reply import Kind
from server.replies import check_think, logprobs_request, pieces_of, raw_grammar, think_value


def _final_stats(outcome: Outcome) -> dict[str, Any]:
    s = outcome.stats
    return {
        "done_reason": s.get("done_reason", "stop"),
        "total_duration": nanoseconds(time.perf_counter() - outcome.started),
        "load_duration": nanoseconds(outcome.load_duration),
        "prompt_eval_count": s.get("prompt_eval_count", 0),
        "prompt_eval_duration": s.get("prompt_eval_duration", 0),
        "eval_count": s.get("eval_count", 0),
        "eval_duration": s.get("eval_duration", 0),
    }


def _stream(handler: Handler, objects: Iterator[dict[str, Any]], stream: bool) -> None:
    """NDJSON when streaming; otherwise the pieces folded into one object."""
    if not stream:
        merged: dict[str, Any] = {}
        for obj in objects:
            for key, value in obj.items():
                if key in ("response", "thinking", "logprobs") and key in merged:
                    merged[key] += value
                elif key == "message" and "message" in merged:
                    _merge_message(merged["message"], value)
                else:
                    merged[key] = value
        handler.send_json(200, merged)
        return
    writer = handler.start_stream(STREAM_CONTENT_TYPE)
    try:
        for obj in objects:
            if not writer.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n"):
                break
    except CorralError as exc:
        writer.write(json.dumps(format_error(exc)[1]).encode() + b"\n")
    writer.end()


def _merge_message(into: dict[str, Any], part: dict[str, Any]) -> None:
    into["content"] += part.get("content", "")
    if part.get("thinking"):
        into["thinking"] = into.get("thinking", "") + part["thinking"]
    if part.get("tool_calls"):
        into["tool_calls"] = into.get("tool_calls", []) + part["tool_calls"]


def _prefetch(objects: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Run up to the first object so errors before any output get a proper status."""
    first = next(objects, None)

    def rest() -> Iterator[dict[str, Any]]:
        if first is not None:
            yield first
        yield from objects
    return rest()


def _model_caps(inf: Inference, record: ModelRecord) -> tuple[str, list[str]]:
    template = inf.template_text(record)
    return template, capabilities(inf.store, record, template)


def _load_or_unload(handler: Handler, inf: Inference, record: ModelRecord, body: dict[str, Any],
                    chat: bool) -> None:
    keep_alive = keep_alive_of(body)
    base: dict[str, Any] = {"model": body["model"], "created_at": rfc3339(time.time())}
    if chat:
        base["message"] = {"role": "assistant", "content": ""}
    else:
        base["response"] = ""
    if keep_alive == 0:
        inf.scheduler.unload(record)
        handler.send_json(200, {**base, "done": True, "done_reason": "unload"})
        return
    inf.load_only(record, inf.options(record, body.get("options")), keep_alive)
    handler.send_json(200, {**base, "done": True, "done_reason": "load"})


def _start(inf: Inference, record: ModelRecord, body: dict[str, Any], req: Request,
           runner_body: dict[str, Any]) -> tuple[Outcome, Iterator[str]]:
    """The parts of a generation that /api/generate and /api/chat share."""
    grammar = raw_grammar(body, inf.settings.max_grammar_bytes, body.get("format")) or \
        grammar_for(body.get("format"), inf.settings.max_grammar_bytes)
    logprobs = logprobs_request(body.get("logprobs"), body.get("top_logprobs"))
    runner_body.update({"grammar": grammar,
                        "truncate": body.get("truncate", True),
                        "shift": body.get("shift", True)})
    if logprobs is not None:
        runner_body["logprobs"] = logprobs
    outcome = Outcome()
    pieces = inf.generate(record, runner_body, inf.options(record, body.get("options")),
                          keep_alive_of(body), outcome, req.on_disconnect)
    return outcome, pieces


def generate(inf: Inference) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        prompt, suffix = body.get("prompt") or "", body.get("suffix") or ""
        if not isinstance(prompt, str) or not isinstance(suffix, str):
            raise BadRequest("prompt must be a string")
        images = inf.images(record, body["images"]) if body.get("images") else []
        if body.get("raw") and (body.get("template") or body.get("system") or body.get("context")):
            raise BadRequest("raw mode does not support template, system, or context")
        template, caps = _model_caps(inf, record)
        if suffix and "insert" not in caps:
            raise BadRequest(f"{record.name.full()} does not support insert")
        think = think_value(body.get("think"))
        check_think(think, caps, body["model"])
        if not prompt and not suffix:
            _load_or_unload(handler, inf, record, body, chat=False)
            return
        outcome, pieces = _start(inf, record, body, req, {
            "prompt": prompt, "raw": bool(body.get("raw")), "suffix": suffix,
            "system": body.get("system") or record.system, "template": body.get("template"),
            "context": body.get("context"), "think": think, "images": images})

        def objects() -> Iterator[dict[str, Any]]:
            for piece in pieces_of(pieces, outcome, template, think, []):
                out = {"model": body["model"], "created_at": rfc3339(time.time()),
                       "response": "", "done": False}
                out["thinking" if piece.kind is Kind.THINKING else "response"] = piece.text
                if piece.logprobs:
                    out["logprobs"] = list(piece.logprobs)
                yield out
            final = {"model": body["model"], "created_at": rfc3339(time.time()), "response": "",
                     "done": True, **_final_stats(outcome)}
            if not body.get("raw"):
                final["context"] = outcome.stats.get("context", [])
            yield final
        _stream(handler, _prefetch(objects()), body.get("stream", True) is not False)
    return route


def chat(inf: Inference) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        messages = body.get("messages")
        messages = [] if messages is None else messages
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list")
        tools = body.get("tools") or []
        template, caps = _model_caps(inf, record)
        if tools and "tools" not in caps:
            raise BadRequest(f"{record.name.full()} does not support tools")
        think = think_value(body.get("think"))
        check_think(think, caps, body["model"])
        full = inf.chat_messages(record, messages)
        if not messages:
            _load_or_unload(handler, inf, record, body, chat=True)
            return
        outcome, pieces = _start(inf, record, body, req, {
            "messages": full, "tools": tools or None, "think": think})

        def objects() -> Iterator[dict[str, Any]]:
            for piece in pieces_of(pieces, outcome, template, think, tools):
                out = {"model": body["model"], "created_at": rfc3339(time.time()),
                       "message": _message_of(piece), "done": False}
                if piece.logprobs:
                    out["logprobs"] = list(piece.logprobs)
                yield out
            yield {"model": body["model"], "created_at": rfc3339(time.time()),
                   "message": {"role": "assistant", "content": ""}, "done": True,
                   **_final_stats(outcome)}
        _stream(handler, _prefetch(objects()), body.get("stream", True) is not False)
    return route


def _message_of(piece: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    if piece.kind is Kind.CONTENT:
        message["content"] = piece.text
    elif piece.kind is Kind.THINKING:
        message["thinking"] = piece.text
    else:
        message["tool_calls"] = [piece.call]
    return message


def embed(inf: Inference) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"), 'model "{}" not found, try pulling it first')
        inputs = body.get("input")
        if inputs in (None, "", []):
            inf.load_only(record, inf.options(record, body.get("options")), keep_alive_of(body))
            handler.send_json(200, {"model": body["model"], "embeddings": []})
            return
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            raise BadRequest("invalid input type")
        started = time.perf_counter()
        dims = body.get("dimensions")
        result, load = inf.embed(record, body, inputs, normalize=True,
                                 dimensions=dims if isinstance(dims, int) and dims > 0 else 0,
                                 on_disconnect=req.on_disconnect)
        vectors = result["embeddings"]
        handler.send_json(200, {"model": body["model"], "embeddings": vectors,
                                "total_duration": nanoseconds(time.perf_counter() - started),
                                "load_duration": nanoseconds(load),
                                "prompt_eval_count": result["prompt_eval_count"]})
    return route


def embeddings(inf: Inference) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"), 'model "{}" not found, try pulling it first')
        prompt = body.get("prompt") or ""
        if not prompt:
            inf.load_only(record, inf.options(record, body.get("options")), keep_alive_of(body))
            handler.send_json(200, {"embedding": []})
            return
        result, _ = inf.embed(record, body, [str(prompt)], normalize=False,
                              on_disconnect=req.on_disconnect)
        handler.send_json(200, {"embedding": result["embeddings"][0]})
    return route
