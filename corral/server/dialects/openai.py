"""OpenAI's API (/v1): chat completions and legacy completions as pipeline requests.

Parse: the wire record (api.wire.openai) into a pipeline request. Render: events
into `chat.completion(.chunk)` / `text_completion` objects, streamed as server-sent
events ending in `[DONE]`, with one choice per `n`. Beside `usage`, llama-server's
`timings` (dialects.timings): on the whole object, or on the stream's last chunk (the
usage chunk when asked for, else each choice's last), with speculative decoding's counts.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any, Callable, Iterator, Sequence

from corral.api.wire.common import ChatToolChoice, FunctionChoice, Timings
from corral.api.wire.openai import (ChatChoice, ChatCompletion, ChatCompletionRequest,
                                    CompletionRequest, Message, Sampling,
                                    TextChoice, TextCompletion, Usage)
from corral.errors import BadRequest, CorralError, Shape, format_error
from corral.runner.wire import Logprob
from corral.server.chat.messages import (Message as ChatMessage, ToolCall, function_tool,
                                         placed_text, tool_named)
from corral.server.http import Handler, Request
from corral.server.chat.images import from_data_uri
from corral.server.chat.models import require_model
from corral.server.pipeline.services import Services
from corral.server.pipeline.request import (ChatTask, ChoiceMode, CompletionTask, Event,
                                            Finished, ToolChoice)
from corral.server.dialects.stream import SSE, generation
from corral.server.dialects.timings import timings
from corral.server.chat.reply import Kind, Piece

FINGERPRINT = "fp_ollama"  # what Ollama sends; some clients read it
EFFORTS = ("max", "high", "medium", "low", "none")


def think_of_effort(effort: str | None) -> bool | str | None:
    """`reasoning_effort` / `reasoning.effort`, as Ollama maps them onto `think`: "none"
    is no thinking, "minimal" is "low", and "max" is "high" (as native `think: "max"`:
    no template knows a level above it)."""
    if effort in (None, ""):
        return None
    if effort == "minimal":
        return "low"
    if effort not in EFFORTS:
        raise BadRequest(f"invalid reasoning value: '{effort}' (must be \"max\", \"high\", "
                         "\"medium\", \"low\", or \"none\")")
    if effort == "max":
        return "high"
    return False if effort == "none" else str(effort)


def _options(wire: Sampling, max_tokens: int | None) -> dict[str, Any]:
    opts: dict[str, Any] = {"temperature": 1.0 if wire.temperature is None else wire.temperature,
                            "top_p": wire.top_p or 1.0}
    for name, value in (("num_predict", max_tokens), ("seed", wire.seed),
                        ("frequency_penalty", wire.frequency_penalty),
                        ("presence_penalty", wire.presence_penalty),
                        ("ignore_eos", wire.ignore_eos)):
        if value is not None:
            opts[name] = value
    if wire.stop is not None:
        opts["stop"] = [wire.stop] if isinstance(wire.stop, str) else wire.stop
    return opts


def _grammar(wire: Sampling) -> str | None:
    grammar = wire.grammar or (wire.options or {}).get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise BadRequest("grammar must be a string")
    return grammar or None


def tool_choice_of(choice: ChatToolChoice) -> ToolChoice:
    if isinstance(choice, FunctionChoice):
        return ToolChoice(ChoiceMode.NAMED, choice.function.name)
    return ToolChoice(ChoiceMode(choice or "auto"))


def _message(m: Message, earlier: list[ChatMessage]) -> ChatMessage:
    content, images = m.content, []
    if isinstance(content, list):
        texts: list[str | None] = []  # None: a media item, in its place
        for part in content:
            if part.type == "text":
                texts.append(part.text)
                continue
            if part.type == "input_audio":  # Ollama's way: audio rides with the images
                images.append(part.input_audio.data)
            else:
                url = part.image_url
                images.append(from_data_uri(url if isinstance(url, str) else url.url))
            texts.append(None)
        content = placed_text(texts)
    calls = []
    for call in m.tool_calls or []:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            raise BadRequest("invalid tool call arguments") from None
        if not isinstance(args, dict | None):
            raise BadRequest("tool call arguments must be a JSON object")
        calls.append(ToolCall(call.function.name, args or {}, call.id or ""))
    call_id = (m.tool_call_id or "") if m.role == "tool" else ""
    return ChatMessage("system" if m.role == "developer" else m.role, content or "",
                       tuple(images), m.reasoning or "", tuple(calls),
                       (m.name or tool_named(earlier, call_id)) if m.role == "tool" else "",
                       call_id)


def structured(kind: str | None, schema: dict[str, Any] | None, what: str) -> Any:
    """OpenAI's structured output ({"type": "text" | "json_object" | "json_schema"}) as
    the pipeline's `format`: None, "json" or the schema."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if schema is None:
        raise BadRequest(f"{what} json_schema needs a schema")
    return schema


def _format(wire: ChatCompletionRequest) -> Any:
    rf = wire.response_format
    return structured(rf.type if rf else None,
                      rf.json_schema.schema_ if rf and rf.json_schema else None,
                      "response_format")


def parse_chat(wire: ChatCompletionRequest) -> ChatTask:
    messages: list[ChatMessage] = []
    for m in wire.messages:
        messages.append(_message(m, messages))
    effort = wire.reasoning.effort if wire.reasoning is not None else wire.reasoning_effort
    logprobs = int(wire.top_logprobs or 0) if wire.logprobs or wire.top_logprobs else None
    return ChatTask(
        model=require_model(wire.model), messages=messages,
        options=_options(wire, wire.max_completion_tokens or wire.max_tokens),
        think=think_of_effort(effort), format=_format(wire), grammar=_grammar(wire),
        logprobs=logprobs, n=wire.n, tools=[function_tool(t) for t in wire.tools or []],
        tool_choice=tool_choice_of(wire.tool_choice))


def parse_completion(wire: CompletionRequest) -> CompletionTask:
    prompt = wire.prompt if isinstance(wire.prompt, str) else wire.prompt[0]
    return CompletionTask(model=require_model(wire.model), prompt=prompt, raw=True,
                             suffix=wire.suffix or "", options=_options(wire, wire.max_tokens),
                             grammar=_grammar(wire), logprobs=wire.logprobs, n=wire.n)


def openai_call(call: ToolCall) -> dict[str, Any]:
    """A call the model made, as OpenAI's: arguments as a JSON string, with its index."""
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


def finish_reason(final: Finished) -> str:
    if final.called:
        return "tool_calls"
    return "length" if final.done_reason == "length" else "stop"


def usage(finals: dict[int, Finished]) -> Usage:
    """OpenAI's usage: the whole prompt (once: the choices share it), the reused part of
    it in cached_tokens, and every choice's output."""
    first = finals.get(0, Finished())
    completion = sum(f.eval_count for f in finals.values())
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


class Stream:
    """What the chat and completion renderers share: ids, SSE framing, usage."""

    content_type = SSE

    def __init__(self, model: str, include_usage: bool, prefix: str, kind: str) -> None:
        self.id, self.created, self.model = (f"{prefix}-{random.randint(0, 998)}",
                                             int(time.time()), model)
        self.head = {"id": self.id, "object": kind, "created": self.created, "model": model,
                     "system_fingerprint": FINGERPRINT}
        self.include_usage = include_usage
        self.finals: dict[int, Finished] = {}

    @staticmethod
    def sse(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def error_frame(self, exc: CorralError) -> bytes:
        return self.sse(format_error(exc, Shape.OPENAI)[1])

    def timings(self) -> Timings:
        """llama-server's timings of every choice, beside usage (dialects.timings)."""
        return timings(final for _, final in sorted(self.finals.items()))

    def timed(self, final: Finished) -> dict[str, Any]:
        """What a choice's last chunk adds: its timings, unless a usage chunk follows and
        carries them, as llama-server puts them on the stream's last chunk."""
        return {} if self.include_usage else {"timings": timings([final])}

    def closing(self) -> Iterator[bytes]:
        if self.include_usage:
            yield self.sse({**self.head, "choices": [], "usage": usage(self.finals),
                            "timings": self.timings()})
        yield b"data: [DONE]\n\n"


class ChatChunks(Stream):
    def __init__(self, model: str, include_usage: bool) -> None:
        super().__init__(model, include_usage, "chatcmpl", "chat.completion.chunk")

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        opened: set[int] = set()
        for event in events:
            if event.index not in opened:
                opened.add(event.index)
                yield self._chunk(event.index, {"role": "assistant", "content": ""})
            if isinstance(event, Finished):
                self.finals[event.index] = event
                yield self._chunk(event.index, {}, finish_reason(event), final=event)
            else:
                yield self._chunk(event.index, _delta(event), None, event.logprobs)
        yield from self.closing()

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None = None,
               logprobs: tuple[Logprob, ...] = (), final: Finished | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": reason}
        if logprobs:
            choice["logprobs"] = {"content": [e.to_json() for e in logprobs]}
        return self.sse({**self.head, "choices": [choice],
                         **(self.timed(final) if final is not None else {})})

    def whole(self, events: Iterator[Event]) -> ChatCompletion:
        parts: dict[int, dict[str, list[Any]]] = {}
        for event in events:
            if isinstance(event, Finished):
                self.finals[event.index] = event
                continue
            got = parts.setdefault(event.index, {"content": [], "reasoning": [], "calls": [],
                                                 "logprobs": []})
            got["logprobs"] += [e.to_json() for e in event.logprobs]
            if event.kind is Kind.CALL:
                assert event.call is not None
                got["calls"].append(openai_call(event.call))
            else:
                got["reasoning" if event.kind is Kind.THINKING else "content"].append(event.text)
        choices = [_choice(i, parts.get(i), final) for i, final in sorted(self.finals.items())]
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                "usage": usage(self.finals), "timings": self.timings()}


def _choice(index: int, got: dict[str, list[Any]] | None, final: Finished) -> ChatChoice:
    got = got or {"content": [], "reasoning": [], "calls": [], "logprobs": []}
    message: dict[str, Any] = {"role": "assistant", "content": "".join(got["content"])}
    if got["reasoning"]:
        message["reasoning"] = message["reasoning_content"] = "".join(got["reasoning"])
    if got["calls"]:
        message["tool_calls"] = got["calls"]
    return {"index": index, "message": message, "finish_reason": finish_reason(final),
            "logprobs": {"content": got["logprobs"]} if got["logprobs"] else None}


def _delta(piece: Piece) -> dict[str, Any]:
    if piece.kind is Kind.THINKING:  # Ollama's field, and the one vLLM and DeepSeek use
        return {"reasoning": piece.text, "reasoning_content": piece.text}
    if piece.kind is Kind.CALL:
        assert piece.call is not None
        return {"tool_calls": [openai_call(piece.call)]}
    return {"content": piece.text}


class TextChunks(Stream):
    def __init__(self, model: str, include_usage: bool, logprobs: bool) -> None:
        super().__init__(model, include_usage, "cmpl", "text_completion")
        self.logprobs = logprobs

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        for event in events:
            if isinstance(event, Finished):
                self.finals[event.index] = event
                yield self.sse({**self.head, "choices": [{
                    "text": "", "index": event.index, "finish_reason": finish_reason(event),
                    "logprobs": None}], **self.timed(event)})
            else:
                yield self.sse({**self.head, "choices": [{
                    "text": event.text, "index": event.index, "finish_reason": None,
                    "logprobs": legacy_logprobs(event.logprobs) if self.logprobs
                    else None}]})
        yield from self.closing()

    def whole(self, events: Iterator[Event]) -> TextCompletion:
        texts: dict[int, list[str]] = {}
        entries: dict[int, list[Logprob]] = {}
        for event in events:
            if isinstance(event, Finished):
                self.finals[event.index] = event
            else:
                texts.setdefault(event.index, []).append(event.text)
                entries.setdefault(event.index, []).extend(event.logprobs)
        choices: list[TextChoice] = [
            {"text": "".join(texts.get(i, [])), "index": i, "finish_reason": finish_reason(final),
             "logprobs": legacy_logprobs(entries.get(i, [])) if self.logprobs else None}
            for i, final in sorted(self.finals.items())]
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                "usage": usage(self.finals), "timings": self.timings()}


def legacy_logprobs(entries: Sequence[Logprob], offset: int = 0) -> dict[str, Any]:
    """The completions API's logprobs: parallel lists, alternatives as {token: logprob}."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def _usage_wanted(wire: Sampling) -> bool:
    return wire.stream_options is not None and wire.stream_options.include_usage


def chat_completions(services: Services) -> Callable[[Request, Handler], None]:
    return generation(services, ChatCompletionRequest, parse_chat,
                      lambda wire, request: ChatChunks(request.model, _usage_wanted(wire)))


def completions(services: Services) -> Callable[[Request, Handler], None]:
    return generation(services, CompletionRequest, parse_completion,
                      lambda wire, request: TextChunks(request.model, _usage_wanted(wire),
                                                       wire.logprobs is not None))
