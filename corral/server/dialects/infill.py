"""llama-server's POST /infill: code completion for llama.vscode, llama.vim and
llama.qtcreator, answered in llama-server's shape (its /completion object; streamed as
`data: {...}` events and no `[DONE]`, as llama-server ends an /infill stream).

The prompt is llama-server's own (runner/fim.py, assembled in the runner from the
vocabulary's FIM tokens) and goes the one generation path as a raw token prompt, so it
is batched with every other sequence and its prefix comes back from the prompt cache as
an editor resends it. `n_indent` and `t_max_predict_ms` are llama-server's stop rules,
applied here to the text as it streams (`Limits`): the generation is cancelled when one
ends it, and the time limit counts from the first token, as llama-server's t_gen does.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

from corral.api.wire import parse
from corral.api.wire.infill import InfillRequest
from corral.errors import BadRequest, CorralError, Shape, format_error
from corral.runner.fim import Infill
from corral.server.http import Handler, Request
from corral.server.pipeline.count import only_loaded
from corral.server.pipeline.request import CompletionTask, Event, Finished
from corral.server.pipeline.run import run
from corral.server.dialects.stream import SSE, respond
from corral.server.dialects.timings import timings
from corral.server.chat.reply import Kind, Piece
from corral.server.pipeline.services import Services, keep_alive_of

Route = Callable[[Request, Handler], None]
Clock = Callable[[], float]


def infill(services: Services) -> Route:
    def route(req: Request, handler: Handler) -> None:
        wire = parse(InfillRequest, req.json())
        model = wire.model or only_loaded(services)
        reason = services.models.view(model).infill
        if reason:
            raise BadRequest(f"Infill is not supported by this model: {reason}")
        extra = tuple((c.filename, c.text) for c in wire.input_extra)
        task = CompletionTask(model=model, prompt="", raw=True, options=wire.options(),
                              keep_alive=keep_alive_of(wire.keep_alive),
                              infill=Infill(wire.input_prefix, wire.input_suffix, extra,
                                            wire.prompt))
        answer = Answer(model, wire, Limits(wire.n_indent, wire.t_max_predict_ms))
        respond(handler, run(services, task, answer.watch(req.on_disconnect)), answer,
                wire.stream)
    return route


class Limits:
    """llama-server's `n_indent` and `t_max_predict_ms` (server-context.cpp,
    process_token), on the text as it arrives. `feed` gives the part of a piece to send
    and sets `stopped` when a rule ends the generation."""

    def __init__(self, n_indent: int, t_max_ms: int, clock: Clock = time.monotonic) -> None:
        self.n_indent, self.t_max_ms, self.clock = n_indent, t_max_ms, clock
        self.text = ""  # what was generated and kept
        self.new_line = False  # a line has ended (llama-server's has_new_line)
        self.last_nl = 0  # where the line being checked starts
        self.started: float | None = None
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.started is None:
            self.started = self.clock()
        sent = len(self.text)
        self.text += piece
        if self.new_line and self.n_indent > 0:
            if self._short_line():
                return self.text[sent:]
            nl = self.text.find("\n", self.last_nl)
            if nl >= 0:
                self.last_nl = nl + 1
        if "\n" in piece:
            self.new_line = True
            if self.t_max_ms > 0 and (self.clock() - self.started) * 1000 > self.t_max_ms:
                self.stopped = True
        return piece

    def _short_line(self) -> bool:
        """A started line indented less than n_indent ends the reply before its text."""
        if self.last_nl <= 0:
            return False
        pos = self.last_nl
        while pos < len(self.text) and self.text[pos] in " \t":
            pos += 1
        if pos < len(self.text) and pos - self.last_nl < self.n_indent:
            self.stopped, self.text = True, self.text[:pos]
            return True
        return False


class Answer:
    """The stream and the whole answer, in llama-server's /completion shape."""

    content_type = SSE

    def __init__(self, model: str, wire: InfillRequest, limits: Limits) -> None:
        self.model, self.wire, self.limits = model, wire, limits
        self.cancel: list[Callable[[], None]] = []

    def watch(self, on_disconnect: Callable[[Callable[[], None]], Any]
              ) -> Callable[[Callable[[], None]], Any]:
        """The run's disconnect hook, kept: a limit cancels the generation through it."""
        def hook(fire: Callable[[], None]) -> Any:
            self.cancel.append(fire)
            return on_disconnect(fire)
        return hook

    def _texts(self, events: Iterator[Event]) -> Iterator[str | Finished]:
        for event in events:
            if isinstance(event, Finished):
                yield event
            elif isinstance(event, Piece) and event.kind is Kind.CONTENT \
                    and not self.limits.stopped:
                text = self.limits.feed(event.text)
                if self.limits.stopped:
                    for fire in self.cancel:
                        fire()
                if text:
                    yield text

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        predicted = 0
        for item in self._texts(events):
            if isinstance(item, Finished):
                yield _sse(self._final(item, ""))
            else:
                predicted += 1
                yield _sse({"index": 0, "content": item, "tokens": [], "stop": False,
                            "id_slot": -1, "tokens_predicted": predicted,
                            "tokens_evaluated": 0})

    def whole(self, events: Iterator[Event]) -> Any:
        final, parts = Finished(), []
        for item in self._texts(events):
            if isinstance(item, Finished):
                final = item
            else:
                parts.append(item)
        return self._final(final, "".join(parts))

    def error_frame(self, exc: CorralError) -> bytes:
        return _sse(format_error(exc, Shape.OPENAI)[1])

    def _final(self, final: Finished, content: str) -> dict[str, Any]:
        """llama-server's final object (server-task.cpp, to_json_non_oaicompat)."""
        wire = self.wire
        if self.limits.stopped or final.done_reason == "length":
            stop_type = "limit"
        else:
            stop_type = "eos" if final.done_reason == "stop" else "none"
        return {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True,
                "model": self.model, "tokens_predicted": final.eval_count,
                "tokens_evaluated": final.prompt_tokens,
                "generation_settings": {**wire.options(), "n_predict": wire.n_predict,
                                        "n_indent": wire.n_indent,
                                        "t_max_predict_ms": wire.t_max_predict_ms},
                "has_new_line": self.limits.new_line or "\n" in content,
                "truncated": False, "stop_type": stop_type, "stopping_word": "",
                "tokens_cached": final.prompt_tokens + final.eval_count,
                "timings": timings([final])}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
