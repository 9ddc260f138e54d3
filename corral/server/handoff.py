"""A route's response messages, handed from its worker thread to the event loop.

A route runs on a worker thread (server.asgi) and its messages are written on the loop.
A blocking round trip for each one (anyio.from_thread.run) parks and wakes the worker
thread for every streamed token, on the cores the model decodes on. Here a streamed
body's chunks are handed over without waiting: one task writes them in order, joining
the chunks that queued up while it wrote into one. At most WINDOW are in flight, so a
slow client still holds its route back; only the response's last message waits until
it is written (a wait for its start too was a round trip between the threads in every
answer), and a failed write is raised at the route's next send, as a blocking send
would have raised it. A response the loop gives up on (the server
stopping: its task is cancelled) fails every send after, so its route never waits on
a pump that is gone.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from starlette.types import Message, Send

WINDOW = 16  # chunks a route may hand over before it waits for the client to take them
POLL = 0.25  # seconds between a waiting route's looks at whether its pump is gone


def _chunk(message: Message) -> bool:
    """A streamed body's chunk that is not its last: written with those queued beside it."""
    return message["type"] == "http.response.body" and bool(message.get("more_body"))


def _last(message: Message) -> bool:
    """The response's last message: the route waits until it is written."""
    return message["type"] == "http.response.body" and not message.get("more_body")


class Handoff:
    """Made on the loop; `pump` runs there for the response's life, and the worker
    thread calls the object itself as the route's `send`."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[Message, threading.Event | None]] = asyncio.Queue()
        self._room = threading.BoundedSemaphore(WINDOW)
        self._error: BaseException | None = None
        self._closed = False  # the pump has ended: nothing handed over is written

    def __call__(self, message: Message) -> None:
        """On the worker thread: hand `message` over; wait for it if it is the last."""
        self._check()
        done = threading.Event() if _last(message) else None
        while not self._room.acquire(timeout=POLL):
            self._check()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (message, done))
        except RuntimeError:  # the loop itself is closed
            self._closed = True
            self._check()
        if done is not None:
            while not done.wait(POLL):
                self._check()
            self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise ConnectionError("the response could not be written") from self._error
        if self._closed:
            raise ConnectionError("the response was abandoned")

    async def pump(self) -> None:
        """On the loop: write what is handed over, in order, until cancelled."""
        try:
            while True:
                items = [await self._queue.get()]
                while _chunk(items[-1][0]) and not self._queue.empty():
                    items.append(self._queue.get_nowait())
                try:
                    await self._write(items)
                except BaseException:  # cancelled mid-write: closed before the route wakes
                    self._closed = True
                    raise
                finally:
                    self._done(items)
        finally:  # cancelled: what is queued is dropped, and the route hears so
            self._closed = True
            while not self._queue.empty():
                self._done([self._queue.get_nowait()])

    def _done(self, items: list[tuple[Message, threading.Event | None]]) -> None:
        for _, done in items:
            self._room.release()
            self._queue.task_done()
            if done is not None:
                done.set()

    async def _write(self, items: list[tuple[Message, Any]]) -> None:
        if self._error is not None:
            return  # the connection failed: what follows is dropped, as it would be
        chunks = [m for m, _ in items]
        last = None if _chunk(chunks[-1]) else chunks.pop()  # only the last may not be one
        try:
            if chunks:
                body = b"".join(m.get("body", b"") for m in chunks)
                await self._send({"type": "http.response.body", "body": body,
                                  "more_body": True})
            if last is not None:
                await self._send(last)
        except Exception as exc:  # noqa: BLE001 - the route hears it at its next send
            self._error = exc

    async def drained(self) -> None:
        """Every message handed over is written (or dropped after a failed write)."""
        await self._queue.join()
