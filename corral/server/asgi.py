"""The daemon's HTTP transport: uvicorn serving a Starlette application.

uvicorn gives conformant HTTP/1.1 (chunked bodies, malformed headers answered
400, keep-alive and idle timeouts, disconnect detection, graceful shutdown);
Starlette matches paths and methods and gives the CORS middleware. Checks run in
this order for every request: header size and header-read time (the protocol) ->
body size -> Host
allowlist (loopback daemons) -> Origin allowlist -> CORS preflight -> API key
-> route lookup (404/405) -> body read -> the route, on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any, Callable

import anyio
import anyio.from_thread
import anyio.to_thread
import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Match, Route as StarletteRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from corral.config import Settings
from corral.errors import (BadRequest, CorralError, Forbidden, MethodNotAllowed, NotFound, Shape,
                           Unauthorized)
from corral.server.http import (Handler, Request, Route, error_response, host_allowed,
                         origin_pattern, too_large)
from corral.server.handoff import Handoff
from corral.server.page import is_page

log = logging.getLogger("corral.http")


ALLOWED_HEADERS = ["Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With",
                   "OpenAI-Beta", "x-api-key", "anthropic-version", "x-stainless-arch",
                   "x-stainless-async", "x-stainless-custom-poll-interval",
                   "x-stainless-helper-method", "x-stainless-lang", "x-stainless-os",
                   "x-stainless-package-version", "x-stainless-poll-helper",
                   "x-stainless-retry-count", "x-stainless-runtime",
                   "x-stainless-runtime-version", "x-stainless-timeout"]


async def send_error(send: Send, exc: CorralError, shape: Shape) -> None:
    status, headers, data = error_response(exc, shape)
    headers.append(("content-length", str(len(data))))
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in headers]})
    await send({"type": "http.response.body", "body": data})


def shape_of(path: str) -> Shape:
    if path.startswith("/v1/messages"):
        return Shape.ANTHROPIC
    if path in ("/tokenize", "/detokenize", "/rerank", "/infill"):  # llama-server's: OpenAI's
        return Shape.OPENAI
    if path.startswith("/v2/"):  # Cohere's v2 API (/v2/rerank)
        return Shape.COHERE
    return Shape.OPENAI if path.startswith("/v1/") else Shape.OLLAMA


class Guard:
    """Refuses, before anything else runs: oversized bodies, foreign hosts and origins."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.origins = origin_pattern(settings.origins)
        self.loopback = settings.host.is_loopback()

    async def __call__(self, scope: Scope, receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        path = scope["path"]
        limit = self.settings.max_body
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            length = 0  # h11 has already refused a malformed Content-Length
        if length > limit and not path.startswith("/api/blobs/"):
            return await send_error(send, too_large(limit), shape_of(path))
        if self.loopback and not host_allowed(headers.get("host", "")):
            return await send_error(send, Forbidden("forbidden"), shape_of(path))
        origin = headers.get("origin")
        if origin and not self.origins.fullmatch(origin):
            return await send_error(send, Forbidden("forbidden"), shape_of(path))
        await self.app(scope, receive, send)


class Dispatcher:
    """Finds the route, reads the body, and runs the route on a worker thread."""

    def __init__(self, routes: list[tuple[str, str, Route]], settings: Settings) -> None:
        # Starlette matches the paths (its `{name:path}` convertor for prefixes) and the
        # methods (HEAD wherever GET is); the route itself stays a blocking function.
        table: dict[str, tuple[list[str], Route]] = {}
        for method, path, route in routes:
            table.setdefault(path, ([], route))[0].append(method)
        self.table = [StarletteRoute(path, route, methods=methods)
                      for path, (methods, route) in table.items()]
        self.settings = settings
        # Every admitted request may hold a thread while it waits or streams: the
        # slots and the queue together, never a fixed small pool.
        self.limiter = anyio.CapacityLimiter(settings.max_queue + 64)

    def find(self, scope: Scope) -> Route | CorralError:
        allowed = False
        for candidate in self.table:
            match, _ = candidate.matches(scope)
            if match is Match.FULL:
                return candidate.endpoint  # type: ignore[no-any-return]
            allowed = allowed or match is Match.PARTIAL  # the path, another method
        if allowed:
            return MethodNotAllowed("405 method not allowed")
        return NotFound("404 page not found")

    async def __call__(self, scope: Scope, receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        headers = Headers(scope=scope)
        key = self.settings.api_key
        if key and needs_key(method, path) and not (
                headers.get("authorization") == f"Bearer {key}"
                or headers.get("x-api-key") == key):
            return await send_error(send, Unauthorized("unauthorized"), shape_of(path))
        route = self.find(scope)
        if isinstance(route, CorralError):
            return await send_error(send, route, Shape.TEXT)
        streamed = path.startswith("/api/blobs/")
        try:
            body = None if streamed else await read_body(receive, self.settings.max_body)
        except CorralError as exc:
            return await send_error(send, exc, shape_of(path))
        async def receive_now() -> Message:
            return await receive()

        request = Request(method, path, scope.get("query_string", b"").decode("latin-1"),
                          headers, body, lambda: dict(anyio.from_thread.run(receive_now)))
        handoff = Handoff(send)
        async with anyio.create_task_group() as tasks:
            if not streamed:
                tasks.start_soon(watch_disconnect, receive, request)
            tasks.start_soon(handoff.pump)
            await anyio.to_thread.run_sync(run_route, route, request, handoff,
                                           limiter=self.limiter)
            await handoff.drained()
            tasks.cancel_scope.cancel()


def needs_key(method: str, path: str) -> bool:
    """Everything but the root and /api/hello (clients check that they answer, Claude Code
    without its key) and the page's own files."""
    return not ((path in ("/", "/api/hello") and method in ("GET", "HEAD"))
                or is_page(method, path))


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body, chunked or not, refused as soon as it passes `limit`."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("request body ended early")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def watch_disconnect(receive: Receive, request: Request) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # Cancelling a runner job is a blocking call: never on the event loop. Every
            # request ends here (uvicorn reports a disconnect once a response is done), so
            # a pooled worker, not a new thread each time: thread churn grew the heap.
            await anyio.to_thread.run_sync(request.disconnected)
            return


def run_route(route: Route, request: Request, send: Callable[[Message], None]) -> None:
    handler = Handler(send, request)
    try:
        route(request, handler)
    except CorralError as exc:
        if not handler.started:
            handler.respond_error(exc, shape_of(request.path))
    except Exception as exc:  # noqa: BLE001 - the daemon keeps serving
        if not handler.started:
            handler.respond_error(exc, shape_of(request.path))
        else:
            log.error("route %s failed mid-response", request.path, exc_info=exc)


class Cors(CORSMiddleware):
    """Starlette's CORS, answering an allowed preflight 204 with no body, as Ollama does."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k != "content-length"}
        return Response(status_code=204, headers=headers)


def build_app(routes: list[tuple[str, str, Route]], settings: Settings) -> ASGIApp:
    app: ASGIApp = Dispatcher(routes, settings)
    cors = Cors(app, allow_origin_regex=origin_pattern(settings.origins).pattern,
                          allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                         "OPTIONS"],
                          allow_headers=ALLOWED_HEADERS, max_age=43200)
    return Guard(cors, settings)


class Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for request heads and our error shape.

    A connection must deliver a complete request head within `header_timeout`
    seconds, so slowly dribbled headers cannot hold connections open for as
    long as they like. Malformed requests are answered in Ollama's error shape.
    """

    header_timeout = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_expired)

    def _head_expired(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request head in time")
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_deadline.cancel()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        status, headers, data = error_response(BadRequest(f"malformed request: {msg}"),
                                               Shape.OLLAMA)
        head = [(k.encode(), v.encode()) for k, v in headers]
        head += [(b"content-length", str(len(data)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=head, reason=b"Bad Request"),
                      h11.Data(data=data), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class HttpServer:
    """uvicorn on a socket bound at construction, so the port is known at once."""

    def __init__(self, app: ASGIApp, host: str, port: int, settings: Settings) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(1024)
        except OSError:
            self.sock.close()
            raise
        Protocol.header_timeout = settings.header_timeout
        config = uvicorn.Config(app, http=Protocol, lifespan="off", log_level="critical",
                                access_log=False, server_header=False,
                                headers=[("server", "corral")], timeout_keep_alive=30,
                                h11_max_incomplete_event_size=settings.max_header_bytes,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def serve(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def wait(self) -> None:
        """Until the server thread ends; interruptible, so signal handlers run meanwhile."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve, name="http", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            threading.Event().wait(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()

