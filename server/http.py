"""The HTTP layer: one handler class, protections in a fixed order, JSON and streams.

Order of checks for every request: body-size limit -> Host allowlist (when
bound to loopback) -> CORS -> optional API key -> route. Every error leaves
through `Handler.respond_error`, which formats it with `corral.errors.format_error`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from api.types import JSON_CONTENT_TYPE
from corral.config import Settings
from corral.errors import (
    BadRequest,
    CorralError,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Shape,
    Unauthorized,
    format_error,
)

log = logging.getLogger("corral.http")

MAX_JSON_BODY = 16 << 20
MAX_JSON_DEPTH = 64
ALLOWED_HEADERS = ("Authorization, Content-Type, User-Agent, Accept, X-Requested-With, "
                   "OpenAI-Beta, x-stainless-arch, x-stainless-async, "
                   "x-stainless-custom-poll-interval, x-stainless-helper-method, x-stainless-lang, "
                   "x-stainless-os, x-stainless-package-version, x-stainless-poll-helper, "
                   "x-stainless-retry-count, x-stainless-runtime, x-stainless-runtime-version, "
                   "x-stainless-timeout")
_BUILTIN_ORIGINS = [r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d+)?", r"app://.*",
                    r"file://.*", r"tauri://.*", r"vscode-webview://.*", r"vscode-file://.*"]


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


class StreamWriter:
    """Chunked transfer encoding; tells the caller when the client has gone."""

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self.handler = handler
        self.closed = False

    def write(self, data: bytes) -> bool:
        if self.closed or not data:
            return not self.closed
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.handler.wfile.flush()
        except OSError:
            self.closed = True
        return not self.closed

    def end(self) -> None:
        if not self.closed:
            try:
                self.handler.wfile.write(b"0\r\n\r\n")
                self.handler.wfile.flush()
            except OSError:
                self.closed = True


def watch_disconnect(sock: socket.socket, on_gone: Callable[[], None],
                     done: threading.Event) -> threading.Thread:
    """Calls on_gone() once if the client closes its connection before `done` is set."""
    def loop() -> None:
        while not done.is_set():
            try:
                readable, _, _ = select.select([sock], [], [], 0.2)
                if done.is_set():
                    return
                if readable and not sock.recv(1, socket.MSG_PEEK):
                    on_gone()
                    return
            except (OSError, ValueError):
                on_gone()
                return
    thread = threading.Thread(target=loop, name="disconnect-watch", daemon=True)
    thread.start()
    return thread


def _depth(value: Any, limit: int) -> bool:
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


class Request:
    """What a route sees: method, path, query, parsed JSON and raw access for blobs."""

    def __init__(self, handler: "Handler", method: str) -> None:
        self.handler = handler
        self.method = method
        parts = urlsplit(handler.path)
        self.path = parts.path
        self.query = parts.query
        self.headers = handler.headers
        self._json: Any = None
        self.consumed = False

    @property
    def length(self) -> int:
        try:
            return max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            raise BadRequest("invalid Content-Length") from None

    def json(self) -> dict[str, Any]:
        if self._json is None:
            length = self.length
            if length > MAX_JSON_BODY:
                raise PayloadTooLarge("request body too large")
            raw = self.handler.rfile.read(length) if length else b""
            self.consumed = True
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
            if not _depth(body, MAX_JSON_DEPTH):
                raise BadRequest("request body is nested too deeply")
            self._json = body
        return dict(self._json)

    def body_chunks(self, chunk: int = 1 << 20) -> Iterable[bytes]:
        self.consumed = True
        remaining = self.length
        while remaining > 0:
            data = self.handler.rfile.read(min(chunk, remaining))
            if not data:
                raise BadRequest("request body ended early")
            remaining -= len(data)
            yield data

    def on_disconnect(self, on_gone: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        watch_disconnect(self.handler.connection, on_gone, done)
        return done


Route = Callable[[Request, "Handler"], None]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "corral"
    routes: dict[tuple[str, str], Route] = {}
    prefix_routes: list[tuple[str, str, Route]] = []
    settings: Settings
    origins: re.Pattern[str]
    loopback: bool = True

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes; with Nagle's algorithm on, the
        # body would wait for the client's delayed ACK (40 ms) on every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    # ---- responses --------------------------------------------------------------------------

    def cors_headers(self) -> None:
        origin = self.headers.get("Origin")
        if origin and self.origins.fullmatch(origin):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", JSON_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.cors_headers()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8"
                  ) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.cors_headers()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def respond_error(self, exc: BaseException, shape: Shape = Shape.OLLAMA) -> None:
        """Every error response leaves through here, in the shape of its API."""
        status, body = format_error(exc, shape)
        if status >= 500 and not isinstance(exc, CorralError):
            log.exception("internal error", exc_info=exc)
        if isinstance(body, dict):
            self.send_json(status, body, {"Retry-After": "1"} if status == 503 else None)
        elif isinstance(body, str):
            self.send_text(status, body)
        else:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def start_stream(self, content_type: str) -> StreamWriter:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.cors_headers()
        self.end_headers()
        return StreamWriter(self)

    # ---- dispatch -------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        request = Request(self, method)
        try:
            if request.length > MAX_JSON_BODY and not request.path.startswith("/api/blobs/"):
                self.close_connection = True
                raise PayloadTooLarge("request body too large")
            if self.loopback and not host_allowed(self.headers.get("Host", "")):
                self._forbidden()
                return
            origin = self.headers.get("Origin")
            if origin and not self.origins.fullmatch(origin):
                self._forbidden()
                return
            if method == "OPTIONS":
                self._preflight()
                return
            key = self.settings.api_key
            if key and not (request.path == "/" and method in ("GET", "HEAD")):
                if self.headers.get("Authorization", "") != f"Bearer {key}":
                    raise Unauthorized("unauthorized")
            route = self._route(method, request.path)
            if route is None:
                return
            route(request, self)
        except CorralError as exc:
            if request.length and not request.consumed:
                self.close_connection = True  # the unread body would corrupt the next request
            self.respond_error(exc)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - the daemon keeps serving
            self.respond_error(exc)

    def _route(self, method: str, path: str) -> Route | None:
        lookup = "GET" if method == "HEAD" else method
        route = self.routes.get((lookup, path)) or self.routes.get((method, path))
        if route is None:
            for m, prefix, fn in self.prefix_routes:
                if path.startswith(prefix) and m in (method, lookup):
                    return fn
            if any(p == path for _, p in self.routes) or any(
                    path.startswith(prefix) for _, prefix, _ in self.prefix_routes):
                self.respond_error(MethodNotAllowed("405 method not allowed"), Shape.TEXT)
            else:
                self.respond_error(NotFound("404 page not found"), Shape.TEXT)
        return route

    def _forbidden(self) -> None:
        self.respond_error(Forbidden("forbidden"))

    def _preflight(self) -> None:
        self.send_response(204)
        self.cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", ALLOWED_HEADERS)
        self.send_header("Access-Control-Max-Age", "43200")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def do_PUT(self) -> None:
        self._dispatch("PUT")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
