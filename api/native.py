"""Ollama's native generation routes: /api/generate, /api/chat, /api/embed(dings)."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from api.errors import BadRequest, CorralError
from api.http import Handler, Request
from api.inference import Inference, Outcome, capabilities, grammar_for, keep_alive_of
from api.schema import STREAM_CONTENT_TYPE, nanoseconds, rfc3339
from api.tools import call_id, parse_tool_calls
from registry.models import ModelRecord


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
                if key == "response" and key in merged:
                    merged[key] += value
                elif key == "message" and "message" in merged:
                    merged["message"]["content"] += value.get("content", "")
                    if value.get("tool_calls"):
                        merged["message"]["tool_calls"] = value["tool_calls"]
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
        writer.write(json.dumps({"error": exc.message}).encode() + b"\n")
    writer.end()


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
    return template, capabilities(record, template)


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
    runner_body.update({"grammar": grammar_for(body.get("format")),
                        "truncate": body.get("truncate", True),
                        "shift": body.get("shift", True)})
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
        if body.get("images"):
            raise BadRequest(f"{record.name.full()} does not support vision")
        if body.get("raw") and (body.get("template") or body.get("system") or body.get("context")):
            raise BadRequest("raw mode does not support template, system, or context")
        template, caps = _model_caps(inf, record)
        if suffix and "insert" not in caps:
            raise BadRequest(f"{record.name.full()} does not support insert")
        if body.get("think") and "thinking" not in caps:
            raise BadRequest(f'"{body["model"]}" does not support thinking')
        if not prompt and not suffix:
            _load_or_unload(handler, inf, record, body, chat=False)
            return
        outcome, pieces = _start(inf, record, body, req, {
            "prompt": prompt, "raw": bool(body.get("raw")), "suffix": suffix,
            "system": body.get("system") or record.system, "template": body.get("template"),
            "context": body.get("context")})

        def objects() -> Iterator[dict[str, Any]]:
            for piece in pieces:
                yield {"model": body["model"], "created_at": rfc3339(time.time()),
                       "response": piece, "done": False}
            final = {"model": body["model"], "created_at": rfc3339(time.time()), "response": "",
                     "done": True, **_final_stats(outcome)}
            if not body.get("raw"):
                final["context"] = outcome.stats.get("context", [])
            yield final
        _stream(handler, _prefetch(objects()), body.get("stream", True) is not False)
    return route


def _chat_messages(record: ModelRecord, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a list of objects")
    out = []
    for m in messages:
        role = str(m.get("role", "")).lower()
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"invalid message role {role!r}")
        if m.get("images"):
            raise BadRequest(f"{record.name.full()} does not support vision")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise BadRequest("message content must be a string")
        out.append({**m, "role": role, "content": content})
    full = list(record.messages) + out
    if record.system and not (full and full[0].get("role") == "system"):
        full.insert(0, {"role": "system", "content": record.system})
    return full


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
        if body.get("think") and "thinking" not in caps:
            raise BadRequest(f'"{body["model"]}" does not support thinking')
        full = _chat_messages(record, messages)
        if not messages:
            _load_or_unload(handler, inf, record, body, chat=True)
            return
        outcome, pieces = _start(inf, record, body, req, {
            "messages": full, "tools": tools or None, "think": body.get("think")})

        def objects() -> Iterator[dict[str, Any]]:
            held: list[str] = []
            for piece in pieces:
                if tools:
                    held.append(piece)  # tool calls arrive whole, once parsed
                    continue
                yield {"model": body["model"], "created_at": rfc3339(time.time()),
                       "message": {"role": "assistant", "content": piece}, "done": False}
            message: dict[str, Any] = {"role": "assistant", "content": ""}
            if tools:
                text = "".join(held)
                calls = parse_tool_calls(text, tools)
                if calls:
                    message["tool_calls"] = [{"id": call_id(), **c} for c in calls]
                else:
                    message["content"] = text
            yield {"model": body["model"], "created_at": rfc3339(time.time()),
                   "message": message, "done": True, **_final_stats(outcome)}
        _stream(handler, _prefetch(objects()), body.get("stream", True) is not False)
    return route


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
        result, load = _run_embed(inf, record, body, inputs, normalize=True)
        vectors = result["embeddings"]
        dims = body.get("dimensions")
        if isinstance(dims, int) and 0 < dims:
            vectors = [_renormalize(v[:dims]) for v in vectors]
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
        result, _ = _run_embed(inf, record, body, [str(prompt)], normalize=False)
        handler.send_json(200, {"embedding": result["embeddings"][0]})
    return route


def _run_embed(inf: Inference, record: ModelRecord, body: dict[str, Any], inputs: list[str],
               normalize: bool) -> tuple[dict[str, Any], float]:
    return inf.embed(record, inputs, inf.options(record, body.get("options")),
                     keep_alive_of(body), bool(body.get("truncate", True)), normalize)


def _renormalize(vector: list[float]) -> list[float]:
    norm = sum(x * x for x in vector) ** 0.5
    return [x / norm for x in vector] if norm else vector
