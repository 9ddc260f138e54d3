"""OpenAI-compatible routes (/v1), translated onto the same inference path as native."""

from __future__ import annotations

import base64
import json
import random
import struct
import time
from typing import Any, Iterator

from corral.errors import BadRequest, CorralError, ModelNotFound, Shape, format_error
from server.http import Handler, Request
from server.inference import Inference, Outcome, grammar_for
from server.tools import ToolCalls, with_tool_calls

SSE = "text/event-stream"


def openai_route(fn: Any) -> Any:
    def route(req: Request, handler: Handler) -> None:
        try:
            fn(req, handler)
        except CorralError as exc:
            handler.respond_error(exc, Shape.OPENAI)
    return route


def _options(body: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {"temperature": body.get("temperature", 1.0),
                            "top_p": body.get("top_p") or 1.0}
    for src, dst in (("max_tokens", "num_predict"), ("max_completion_tokens", "num_predict"),
                     ("seed", "seed"), ("frequency_penalty", "frequency_penalty"),
                     ("presence_penalty", "presence_penalty")):
        if body.get(src) is not None:
            opts[dst] = body[src]
    if body.get("ignore_eos") is not None:  # llama-server's extension, for benchmarks
        opts["ignore_eos"] = bool(body["ignore_eos"])
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("invalid type for 'stop' field")
        opts["stop"] = stop
    return opts


def _format(body: dict[str, Any]) -> Any:
    rf = body.get("response_format") or {}
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs a schema")
        return schema
    return None


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("[] is too short - 'messages'")
    out = []
    for m in raw:
        if not isinstance(m, dict):
            raise BadRequest("invalid message")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif isinstance(part, dict) and part.get("type") == "image_url":
                    raise BadRequest("this model does not support images")
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                raise BadRequest("invalid tool call arguments") from None
            calls.append({"function": {"name": fn.get("name"), "arguments": args}})
        if calls:
            msg["tool_calls"] = calls
        if m.get("role") == "tool" and m.get("name"):
            msg["tool_name"] = m["name"]
        out.append(msg)
    return out


def _openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama-shaped calls as OpenAI's: arguments as a JSON string, with an index."""
    return [{"id": c["id"], "index": i, "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"]["arguments"])}}
            for i, c in enumerate(calls)]


def _split(items: Iterator[str | ToolCalls]) -> tuple[list[str], list[dict[str, Any]]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, ToolCalls):
            calls = _openai_calls(item.calls)
        else:
            texts.append(item)
    return texts, calls


def _finish_reason(outcome: Outcome) -> str:
    return "length" if outcome.stats.get("done_reason") == "length" else "stop"


def _usage(outcome: Outcome) -> dict[str, int]:
    p = int(outcome.stats.get("prompt_eval_count", 0))
    c = int(outcome.stats.get("eval_count", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(handler: Handler, events: Iterator[dict[str, Any]]) -> None:
    writer = handler.start_stream(SSE)
    try:
        for event in events:
            if not writer.write(b"data: " + json.dumps(event, ensure_ascii=False).encode()
                                + b"\n\n"):
                return
    except CorralError as exc:
        writer.write(b"data: " + json.dumps(format_error(exc, Shape.OPENAI)[1]).encode()
                     + b"\n\n")
        writer.end()
        return
    writer.write(b"data: [DONE]\n\n")
    writer.end()


def chat_completions(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        messages = inf.chat_messages(record, _messages(body.get("messages")))
        tools = body.get("tools") or []
        options = inf.options(record, _options(body))
        outcome = Outcome()
        pieces = inf.generate(record, {"messages": messages, "tools": tools or None,
                                       "grammar": grammar_for(_format(body),
                                                              inf.settings.max_grammar_bytes)},
                              options, None, outcome, req.on_disconnect)
        cid, created, model = f"chatcmpl-{random.randint(0, 998)}", int(time.time()), body["model"]
        base = {"id": cid, "created": created, "model": model, "system_fingerprint": "fp_ollama"}

        def reason(calls: list[dict[str, Any]]) -> str:
            return "tool_calls" if calls else _finish_reason(outcome)

        if not body.get("stream"):
            texts, calls = _split(with_tool_calls(pieces, tools))
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            handler.send_json(200, {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": reason(calls)}],
                "usage": _usage(outcome)})
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def events() -> Iterator[dict[str, Any]]:
            chunk = {**base, "object": "chat.completion.chunk"}
            yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "finish_reason": None}]}
            calls: list[dict[str, Any]] = []
            for item in with_tool_calls(pieces, tools):
                delta: dict[str, Any] = {"content": item}
                if isinstance(item, ToolCalls):
                    calls = _openai_calls(item.calls)
                    delta = {"content": "", "tool_calls": calls}
                yield {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            yield {**chunk, "choices": [{"index": 0, "delta": {},
                                         "finish_reason": reason(calls)}]}
            if include_usage:
                yield {**chunk, "choices": [], "usage": _usage(outcome)}
        _sse(handler, events())
    return route


def completions(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        options = inf.options(record, _options(body))
        outcome = Outcome()
        pieces = inf.generate(record, {"prompt": prompt, "raw": True,
                                       "suffix": body.get("suffix") or ""},
                              options, None, outcome, req.on_disconnect)
        base = {"id": f"cmpl-{random.randint(0, 998)}", "object": "text_completion",
                "created": int(time.time()), "model": body["model"],
                "system_fingerprint": "fp_ollama"}

        if not body.get("stream"):
            text = "".join(pieces)
            handler.send_json(200, {**base, "choices": [
                {"text": text, "index": 0, "finish_reason": _finish_reason(outcome),
                 "logprobs": None}],
                "usage": _usage(outcome)})
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def events() -> Iterator[dict[str, Any]]:
            for piece in pieces:
                yield {**base, "choices": [{"text": piece, "index": 0, "finish_reason": None,
                                            "logprobs": None}]}
            yield {**base, "choices": [{"text": "", "index": 0,
                                        "finish_reason": _finish_reason(outcome),
                                        "logprobs": None}]}
            if include_usage:
                yield {**base, "choices": [], "usage": _usage(outcome)}
        _sse(handler, events())
    return route


def embeddings(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        record = inf.record(body.get("model"))
        inputs = body.get("input")
        if inputs == "":
            inputs = [""]
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str)
                                                                for i in inputs):
            raise BadRequest("invalid input")
        fmt = str(body.get("encoding_format") or "float").lower()
        if fmt not in ("float", "base64"):
            raise BadRequest(f"Invalid value for 'encoding_format' = {fmt}. "
                             "Supported values: ['float', 'base64'].")
        result, _ = inf.embed(record, body, [i or " " for i in inputs], normalize=True,
                              on_disconnect=req.on_disconnect)
        data = []
        for i, vector in enumerate(result["embeddings"]):
            value: Any = vector
            if fmt == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "embedding": value, "index": i})
        n = int(result["prompt_eval_count"])
        handler.send_json(200, {"object": "list", "data": data, "model": body["model"],
                                "usage": {"prompt_tokens": n, "total_tokens": n}})
    return route


def _model_object(entry: Any, shown: str | None = None) -> dict[str, Any]:
    return {"id": shown or entry.name.display(), "object": "model",
            "created": int(entry.modified_at), "owned_by": entry.name.namespace}


def models(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        entries = sorted(inf.store.list_models(), key=lambda e: -e.modified_at)
        handler.send_json(200, {"object": "list", "data": [_model_object(e) for e in entries]})
    return route


def model(inf: Inference) -> Any:
    @openai_route
    def route(req: Request, handler: Handler) -> None:
        name = req.path[len("/v1/models/"):]
        try:
            entry = inf.store.entry(name)
        except CorralError:
            raise ModelNotFound(f"model '{name}' not found") from None
        handler.send_json(200, _model_object(entry, name))
    return route
