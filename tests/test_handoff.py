"""The route's sends, handed from a worker thread to the event loop (server.handoff)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import pytest

from corral.server.handoff import WINDOW, Handoff


def chunk(data: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": True}


def serve(route: Callable[[Handoff], None], send: Callable[[dict[str, Any]], Any]) -> None:
    """Run `route` on a worker thread against a Handoff on a fresh loop, as asgi does."""
    async def main() -> None:
        handoff = Handoff(send)
        pump = asyncio.ensure_future(handoff.pump())
        await asyncio.wait_for(asyncio.to_thread(route, handoff), 60)
        await asyncio.wait_for(handoff.drained(), 60)
        pump.cancel()

    asyncio.run(main())


def test_chunks_arrive_in_order_and_the_last_message_waits_until_written() -> None:
    written: list[dict[str, Any]] = []
    last_written = threading.Event()

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        written.append(message)
        if not message.get("more_body"):
            last_written.set()

    def route(send_: Handoff) -> None:
        send_({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(200):
            send_(chunk(b"%d," % i))
        send_({"type": "http.response.body", "body": b"", "more_body": False})
        assert last_written.is_set()  # the end was written before the route went on

    serve(route, send)
    assert written[0]["type"] == "http.response.start"
    assert written[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    body = b"".join(m["body"] for m in written[1:-1])
    assert body == b"".join(b"%d," % i for i in range(200))
    assert all(m["more_body"] for m in written[1:-1])


def test_a_response_start_is_handed_over_without_waiting_to_be_written() -> None:
    """Only the last message waits: a wait for the start too was one more round trip
    between the route's thread and the loop before every answer."""
    release = threading.Event()
    written: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        for _ in range(10_000):  # the route releases it; ten seconds at most
            if release.is_set():
                break
            await asyncio.sleep(0.001)
        written.append(message["type"])

    def route(send_: Handoff) -> None:
        send_({"type": "http.response.start", "status": 200, "headers": []})
        assert written == []  # handed over, not written yet
        release.set()
        send_({"type": "http.response.body", "body": b"{}", "more_body": False})
        assert written == ["http.response.start", "http.response.body"]

    serve(route, send)


def test_a_client_that_does_not_read_holds_the_route_back_after_the_window() -> None:
    release = threading.Event()
    handed = []

    async def send(message: dict[str, Any]) -> None:
        while not release.is_set():  # the client takes nothing until released
            await asyncio.sleep(0.001)

    def route(send_: Handoff) -> None:
        for i in range(WINDOW * 3):
            send_(chunk(b"x"))
            handed.append(i)

    def watcher() -> None:
        # The first write is stuck: the route hands over one window, then waits. (A
        # slow machine only makes this check weaker, never fail wrongly.)
        pause = threading.Event()
        for _ in range(60_000):
            if len(handed) >= WINDOW or pause.wait(0.001):
                break
        pause.wait(0.05)
        seen.append(len(handed))
        release.set()

    seen: list[int] = []
    helper = threading.Thread(target=watcher)
    helper.start()
    serve(route, send)
    helper.join(60)
    assert seen == [WINDOW]
    assert len(handed) == WINDOW * 3


def test_a_failed_write_is_raised_at_the_next_send() -> None:
    async def send(message: dict[str, Any]) -> None:
        raise OSError("connection reset")

    errors: list[BaseException] = []

    def route(send_: Handoff) -> None:
        send_({"type": "http.response.start", "status": 200, "headers": []})  # no wait
        with pytest.raises(ConnectionError) as first:
            send_({"type": "http.response.body", "body": b"x", "more_body": False})
        assert str(first.value.__cause__) == "connection reset"
        try:
            send_(chunk(b"after"))
        except ConnectionError as exc:
            errors.append(exc)

    serve(route, send)
    assert errors  # nothing sent after a failure passes silently


def test_a_response_the_loop_gives_up_on_fails_its_route_instead_of_hanging() -> None:
    """The server stopping cancels the response's task: the route, still streaming on
    its worker thread, gets an error at its next send, not a wait without end."""
    stuck = threading.Event()
    outcome: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        stuck.set()
        await asyncio.sleep(3600)  # a client that takes nothing

    def route(send_: Handoff) -> None:
        try:
            for _ in range(WINDOW * 4):
                send_(chunk(b"x"))
            send_({"type": "http.response.body", "body": b"", "more_body": False})
            outcome.append("sent")
        except ConnectionError:
            outcome.append("abandoned")

    async def main() -> None:
        handoff = Handoff(send)
        pump = asyncio.ensure_future(handoff.pump())
        worker = asyncio.ensure_future(asyncio.to_thread(route, handoff))
        await asyncio.wait_for(asyncio.to_thread(stuck.wait, 60), 60)
        pump.cancel()
        await asyncio.wait_for(worker, 60)

    asyncio.run(main())
    assert outcome == ["abandoned"]
