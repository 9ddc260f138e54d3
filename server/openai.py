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
from server.images import from_data_uri
from server.inference import Inference, Outcome, capabilities, grammar_for
from server.reply import Kind, Piece
from server.replies import check_think, logprobs_request, pieces_of, raw_grammar

SSE = "text/event-stream"


def shaped_route(shape: Shape) -> Any:
    """A route whose errors take `shape`: OpenAI's or Anthropic's body, not Ollama's."""
    def decorate(fn: Any) -> Any:
        def route(req: Request, handler: Handler) -> None:
            try:
                fn(req, handler)
            except CorralError as exc:
                handler.respond_error(exc, shape)
        return route
    return decorate


openai_route = shaped_route(Shape.OPENAI)


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
    out: list[dict[str, Any]] = []
    for m in raw:
        if not isinstance(m, dict):
            raise BadRequest("invalid message")
        content = m.get("content")
        images = []
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    images.append(from_data_uri(url.get("url") if isinstance(url, dict)
                                                else url))
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
        if images:
            msg["images"] = images
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise BadRequest("invalid tool call arguments") from None
            calls.append({"id": call.get("id", ""),
                          "function": {"name": fn.get("name"), "arguments": args}})
        if calls:
            msg["tool_calls"] = calls
        if isinstance(m.get("reasoning"), str) and m["reasoning"]:
            msg["thinking"] = m["reasoning"]
        if m.get("role") == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
            msg["tool_name"] = m.get("name") or _name_of_call(out, msg["tool_call_id"])
        out.append(msg)
    return out


def _name_of_call(earlier: list[dict[str, Any]], call_id: str) -> str:
    """The tool a `tool_call_id` answers, from the assistant turn that made the call."""
    for m in reversed(earlier):
        for call in m.get("tool_calls") or []:
            if call_id and call.get("id") == call_id:
                return str(call["function"].get("name") or "")
    return ""


def _think(body: dict[str, Any]) -> bool | str | None:
    """`reasoning_effort` or `reasoning.effort`, as Ollama maps them onto `think`."""
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else \
        body.get("reasoning_effort")
    if effort in (None, ""):
        return None
    if effort not in ("high", "medium", "low", "none"):
        raise BadRequest(f"invalid reasoning value: '{effort}' (must be \"high\", "
                         "\"medium\", \"low\", or \"none\")")
    return False if effort == "none" else str(effort)


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    """An Ollama-shaped call as OpenAI's: arguments as a JSON string, with its index."""
    fn = call["function"]
    return {"index": fn.get("index", 0), "id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(fn["arguments"])}}


def _delta(piece: Piece) -> dict[str, Any]:
    if piece.kind is Kind.THINKING:  # Ollama's field, and the one vLLM and DeepSeek use
        return {"reasoning": piece.text, "reasoning_content": piece.text}
    if piece.kind is Kind.CALL:
        assert piece.call is not None
        return {"tool_calls": [_openai_call(piece.call)]}
    return {"content": piece.text}


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
        think = _think(body)
        template = inf.template_text(record)
        check_think(think, capabilities(inf.store, record, template), body["model"])
        options = inf.options(record, _options(body))
        limit = inf.settings.max_grammar_bytes
        outcome = Outcome()
        runner_body = {"messages": messages, "tools": tools or None, "think": think,
                       "grammar": raw_grammar(body, limit, _format(body)) or
                       grammar_for(_format(body), limit)}
        logprobs = logprobs_request(body.get("logprobs"), body.get("top_logprobs"))
        if logprobs is not None:
            runner_body["logprobs"] = logprobs
        text = inf.generate(record, runner_body, options, None, outcome, req.on_disconnect)
        pieces = pieces_of(text, outcome, template, think, tools)
        cid, created, model = f"chatcmpl-{random.randint(0, 998)}", int(time.time()), body["model"]
        base = {"id": cid, "created": created, "model": model, "system_fingerprint": "fp_ollama"}
        if not body.get("stream"):
            handler.send_json(200, {**base, "object": "chat.completion",
                                    **_whole_reply(pieces, outcome)})
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def events() -> Iterator[dict[str, Any]]:
            chunk = {**base, "object": "chat.completion.chunk"}
            yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "finish_reason": None}]}
            called = False
            for piece in pieces:
                called = called or piece.kind is Kind.CALL
                choice: dict[str, Any] = {"index": 0, "delta": _delta(piece),
                                          "finish_reason": None}
                if piece.logprobs:
                    choice["logprobs"] = {"content": list(piece.logprobs)}
                yield {**chunk, "choices": [choice]}
            yield {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason":
                                         "tool_calls" if called else _finish_reason(outcome)}]}
            if include_usage:
                yield {**chunk, "choices": [], "usage": _usage(outcome)}
        _sse(handler, events())
    return route


def _whole_reply(pieces: Iterator[Piece], outcome: Outcome) -> dict[str, Any]:
    """A non-streamed chat completion's choices and usage."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []
    for piece in pieces:
        logprobs += piece.logprobs
        if piece.kind is Kind.CALL:
            assert piece.call is not None
            calls.append(_openai_call(piece.call))
        else:
            (reasoning if piece.kind is Kind.THINKING else content).append(piece.text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if reasoning:
        message["reasoning"] = message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    reason = "tool_calls" if calls else _finish_reason(outcome)
    choice = {"index": 0, "message": message, "finish_reason": reason,
              "logprobs": {"content": logprobs} if logprobs else None}
    return {"choices": [choice], "usage": _usage(outcome)}


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
        runner_body: dict[str, Any] = {"prompt": prompt, "raw": True,
                                       "suffix": body.get("suffix") or ""}
        top = body.get("logprobs")  # legacy completions: an integer, the alternatives wanted
        if top is not None:
            runner_body["logprobs"] = logprobs_request(True, top)
        pieces = inf.generate(record, runner_body, options, None, outcome, req.on_disconnect)
        base = {"id": f"cmpl-{random.randint(0, 998)}", "object": "text_completion",
                "created": int(time.time()), "model": body["model"],
                "system_fingerprint": "fp_ollama"}

        wanted = top is not None
        if not body.get("stream"):
            texts, entries = [], []
            for piece in pieces:
                texts.append(piece)
                entries += outcome.logprobs
            handler.send_json(200, {**base, "choices": [
                {"text": "".join(texts), "index": 0, "finish_reason": _finish_reason(outcome),
                 "logprobs": _legacy_logprobs(entries) if wanted else None}],
                "usage": _usage(outcome)})
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def events() -> Iterator[dict[str, Any]]:
            for piece in pieces:
                yield {**base, "choices": [{"text": piece, "index": 0, "finish_reason": None,
                                            "logprobs": _legacy_logprobs(outcome.logprobs)
                                            if wanted else None}]}
            yield {**base, "choices": [{"text": "", "index": 0,
                                        "finish_reason": _finish_reason(outcome),
                                        "logprobs": None}]}
            if include_usage:
                yield {**base, "choices": [], "usage": _usage(outcome)}
        _sse(handler, events())
    return route


def _legacy_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The completions API's logprobs: parallel lists, alternatives as {token: logprob}."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


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
