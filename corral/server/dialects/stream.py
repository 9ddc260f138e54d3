"""The one stream writer, with one policy for every API.

Nothing is sent until the generation's first event has arrived: anything that
fails before it (a full queue, a model that will not load, a prompt over the
context, a grammar that does not parse) is a real HTTP status, in the API's error
shape. Once the stream has started, a failure is the API's own in-stream error
event, and the stream ends cleanly.

A live renderer (one with a `keepalive`, Anthropic's) opens its stream as soon as
the request is admitted (the scheduler took it and its model is ready), before the
first token, and sends its keep-alive frame whenever nothing else went out for
`keepalive` seconds: a client's idle timer never sees silence through a long
prompt's prefill. A full queue or a model that will not load is still a status.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Protocol, TypeVar, Union

from corral.api.wire import Wire, parse
from corral.errors import CorralError
from corral.server.http import Handler, Request, Route, StreamWriter
from corral.server.pipeline.request import ChatTask, CompletionTask, Event
from corral.server.pipeline.run import run

if TYPE_CHECKING:
    from corral.server.pipeline.services import Services

log = logging.getLogger("corral.stream")

SSE = "text/event-stream"


class Renderer(Protocol):
    """A dialect's half of a response: its bytes for a stream, its object for a whole."""

    content_type: str

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        """The stream's frames, the closing one included."""
        ...

    def whole(self, events: Iterator[Event]) -> Any:
        """The JSON body of a response that is not streamed."""
        ...

    def error_frame(self, exc: CorralError) -> bytes:
        """The API's in-stream error event."""
        ...


@dataclass(frozen=True)
class Idle:
    """A live renderer's cue for a keep-alive: the request was admitted, or nothing came
    for its `keepalive` seconds since."""


def respond(handler: Handler, events: Iterator[Event], renderer: Renderer, stream: bool) -> None:
    first = next(events, None)  # errors up to here become a status, by the route's shape
    rest: Iterator[Event] = itertools.chain([first], events) if first is not None else events
    if not stream:
        handler.send_json(200, renderer.whole(rest))
        return
    _write(handler, handler.start_stream(renderer.content_type), renderer, rest)


def respond_live(handler: Handler, events: Iterator[Event], renderer: Renderer,
                 live: Live) -> None:
    """A live renderer's stream: opened at the admission, kept alive while nothing comes."""
    marked = with_idle(events, live)
    try:
        first = next(marked, None)  # errors up to the admission become a status
        rest = itertools.chain([first], marked) if first is not None else marked
        _write(handler, handler.start_stream(renderer.content_type), renderer, rest)
    finally:
        marked.close()


def _write(handler: Handler, writer: StreamWriter, renderer: Renderer,
           events: Iterator[Any]) -> None:
    try:
        for frame in renderer.frames(events):
            if not writer.write(frame):
                break  # the client left; its disconnect already cancelled the generation
    except CorralError as exc:
        writer.write(renderer.error_frame(exc))
    except Exception as exc:  # noqa: BLE001 - a bug must still end the stream in shape
        log.error("internal error while streaming %s", handler.request.path, exc_info=exc)
        writer.write(renderer.error_frame(CorralError("internal server error")))
    writer.end()


_END = object()
_ADMITTED = object()


@dataclass(frozen=True)
class _Raised:
    exc: BaseException


class Live:
    """One live stream's hand-off: the generation's events, and its admission, in one
    queue (run() calls `admit` once the scheduler has taken the request)."""

    def __init__(self, keepalive: float) -> None:
        self.keepalive = keepalive
        self.out: queue.Queue[Any] = queue.Queue()

    def admit(self) -> None:
        self.out.put(_ADMITTED)


def with_idle(events: Iterator[Event], live: Live) -> Generator[Union[Event, Idle], None, None]:
    """`events`, with an Idle at the admission and wherever none came for the keep-alive
    after it. The generation runs on a thread of its own, so that waiting for it can
    time out; closing this iterator makes that thread close the generation once its
    next event comes (a client that left has already cancelled it, so that is soon)."""
    out, stop = live.out, threading.Event()

    def pump() -> None:
        try:
            for event in events:
                out.put(event)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - raised again on the reader's side
            out.put(_Raised(exc))
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # its holds and watchers end on the thread that ran it
            out.put(_END)

    threading.Thread(target=pump, daemon=True, name="stream-pump").start()
    admitted = False
    try:
        while True:
            try:  # before the admission a wait has the scheduler's own deadlines
                item = out.get(timeout=live.keepalive) if admitted else out.get()
            except queue.Empty:
                yield Idle()
                continue
            if item is _ADMITTED:
                if not admitted:
                    admitted = True
                    yield Idle()
            elif item is _END:
                return
            elif isinstance(item, _Raised):
                raise item.exc
            else:
                yield item
    finally:
        stop.set()


W = TypeVar("W", bound=Wire)
R = TypeVar("R", ChatTask, CompletionTask)


def generation(services: Services, record: type[W], to_request: Callable[[W], R],
               renderer: Callable[[W, R], Renderer],
               nothing_to_do: Callable[[W, R, Handler], bool] | None = None) -> Route:
    """A dialect's generation route: its wire record, parsed into a request, run on the
    one path and rendered. `nothing_to_do` answers requests that generate nothing
    (Ollama's load and unload) and says whether it did. Errors before the stream starts
    take the API's shape where every route's do: in the transport (asgi.run_route)."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(record, req.json())
        request = to_request(wire)
        if nothing_to_do is not None and nothing_to_do(wire, request, handler):
            return
        answer, stream = renderer(wire, request), bool(getattr(wire, "stream", False))
        keepalive = getattr(answer, "keepalive", None)
        if stream and keepalive:
            live = Live(keepalive)
            respond_live(handler, run(services, request, req.on_disconnect, live.admit),
                         answer, live)
            return
        respond(handler, run(services, request, req.on_disconnect), answer, stream)
    return route
