"""What a route sees: a Request to read and a Handler to answer through.

Routes are plain functions, `route(request, handler)`, run on worker threads
(server.asgi starts them), so they may block on the scheduler and the runner.
The Handler turns their answers into ASGI messages on the event loop: JSON,
text, or a chunked stream whose writes report when the client has gone.
Every error leaves through `Handler.respond_error`, which formats it with
`corral.errors.format_error`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

from corral.api.types import JSON_CONTENT_TYPE
from corral.errors import BadRequest, CorralError, PayloadTooLarge, Shape, format_error

log = logging.getLogger("corral.http")

MAX_JSON_DEPTH = 64
_BUILTIN_ORIGINS = [r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d+)?", r"app://.*",
                    r"file://.*", r"tauri://.*", r"vscode-webview://.*", r"vscode-file://.*"]

Message = dict[str, Any]
# Delivers one ASGI message from a worker thread: a streamed chunk without waiting for it
# to be written, anything else once written (server.handoff).
Send = Callable[[Message], None]
Receive = Callable[[], Message]


def origin_pattern(extra: Iterable[str]) -> re.Pattern[str]:
    parts = list(_BUILTIN_ORIGINS)
    for origin in extra:
        if origin == "*":
            parts.append(r".*")
        else:
            parts.append(".*".join(re.escape(p) for p in origin.split("*")))
    return re.compile("|".join(f"(?:{p})" for p in parts))


def host_allowed(host_header: str) -> bool:
    """DNS-rebinding guard: a loopback daemon answers only to local names and addresses."""
    if not host_header:
        return True
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":")[0]
    host = host.lower().rstrip(".")
    if host in ("localhost", socket.gethostname().lower()) or host.endswith(
            (".localhost", ".local", ".internal")):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local


def error_response(exc: BaseException, shape: Shape) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body of an error: the one place an error becomes bytes."""
    status, body = format_error(exc, shape)
    headers: list[tuple[str, str]] = []
    data = b""
    if isinstance(body, dict):
        data = json.dumps(body, ensure_ascii=False).encode()
        headers.append(("content-type", JSON_CONTENT_TYPE))
    elif isinstance(body, str):
        data = body.encode()
        headers.append(("content-type", "text/plain; charset=utf-8"))
    if status == 503:
        headers.append(("retry-after", "1"))
    return status, headers, data


def _depth_ok(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _without_lone_surrogates(value: Any) -> Any:
    """JSON may escape half a surrogate pair ("\\ud800"); no tokenizer or UTF-8 encoder takes
    one. Each becomes U+FFFD, as Go's JSON decoder (and so Ollama) does."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v)
                for k, v in value.items()}
    return value


class Request:
    """The request a route reads: method, path, query, headers, and a JSON or streamed body."""

    def __init__(self, method: str, path: str, query: str, headers: Mapping[str, str],
                 body: bytes | None, receive: Receive) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self._body = body  # read in full before the route runs; None for streamed uploads
        self._receive = receive
        self._watchers: list[tuple[Callable[[], None], threading.Event]] = []
        self._lock = threading.Lock()
        self.gone = threading.Event()

    def json(self) -> dict[str, Any]:
        raw = self._body or b""
        if not raw.strip():
            raise BadRequest("missing request body")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"invalid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if not _depth_ok(body, MAX_JSON_DEPTH):
            raise BadRequest("request body is nested too deeply")
        if b"\\ud" in raw.lower():
            body = _without_lone_surrogates(body)
        return dict(body)

    def body(self) -> bytes:
        """The whole body, as the transport read it (within CORRAL_MAX_BODY)."""
        return self._body or b""

    def body_chunks(self) -> Iterator[bytes]:
        """A streamed body (blob uploads), chunked or not, as it arrives."""
        if self._body is not None:
            if self._body:
                yield self._body
            return
        while True:
            message = self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected()
                raise BadRequest("request body ended early")
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body"):
                return

    def on_disconnect(self, on_gone: Callable[[], None]) -> threading.Event:
        """Call `on_gone` once if the client leaves before the returned event is set."""
        done = threading.Event()
        with self._lock:
            already = self.gone.is_set()
            if not already:
                self._watchers.append((on_gone, done))
        if already:
            on_gone()
        return done

    def disconnected(self) -> None:
        with self._lock:
            if self.gone.is_set():
                return
            self.gone.set()
            watchers, self._watchers = self._watchers, []
        log.debug("client left %s %s", self.method, self.path)
        for on_gone, done in watchers:
            if not done.is_set():
                on_gone()


class StreamWriter:
    """Chunks of a streamed response; `write` is False once the client has gone."""

    def __init__(self, send: Send, request: Request) -> None:
        self._send = send
        self._request = request
        self.ended = False

    @property
    def closed(self) -> bool:
        return self._request.gone.is_set()

    def write(self, data: bytes) -> bool:
        if self.closed or not data:
            return not self.closed
        try:
            self._send({"type": "http.response.body", "body": data, "more_body": True})
        except Exception:  # noqa: BLE001 - the connection went away under us
            self._request.disconnected()
        return not self.closed

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            try:
                self._send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001
                self._request.disconnected()


class Handler:
    """How a route answers: once, as JSON or text, or as a stream."""

    def __init__(self, send: Send, request: Request) -> None:
        self._send = send
        self.request = request
        self.command = request.method
        self.started = False

    def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        if self.started:
            raise RuntimeError("a response was already started")
        self.started = True
        self._send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]})

    def _whole(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        headers = headers + [("content-length", str(len(data)))]
        self._start(status, headers)
        body = b"" if self.command == "HEAD" else data
        try:
            self._send({"type": "http.response.body", "body": body, "more_body": False})
        except Exception:  # noqa: BLE001 - the client left before the answer
            self.request.disconnected()

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        extra = [(k.lower(), v) for k, v in (headers or {}).items()]
        self._whole(status, [("content-type", JSON_CONTENT_TYPE), *extra], data)

    def send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8"
                  ) -> None:
        self._whole(status, [("content-type", content_type)], text.encode())

    def send_bytes(self, status: int, data: bytes, headers: list[tuple[str, str]]) -> None:
        self._whole(status, headers, data)

    def respond_error(self, exc: BaseException, shape: Shape = Shape.OLLAMA) -> None:
        """Every error response of a route leaves through here, in the shape of its API."""
        if not isinstance(exc, CorralError):
            log.error("internal error in %s %s", self.command, self.request.path,
                      exc_info=exc)
        self._whole(*error_response(exc, shape))

    def start_stream(self, content_type: str) -> StreamWriter:
        self._start(200, [("content-type", content_type), ("cache-control", "no-cache")])
        return StreamWriter(self._send, self.request)


Route = Callable[[Request, Handler], None]


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body too large (limit {limit} bytes)")
