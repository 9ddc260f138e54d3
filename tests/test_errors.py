"""The one error formatter: each API's shape, and types that survive the runner boundary."""

from __future__ import annotations

import pytest

from corral.errors import (BadRequest, ContextOverflow, CorralError, Forbidden, InvalidDigest,
                           ModelNotFound, RunnerError, ServerBusy, Shape, format_error, from_wire)


def test_each_api_gets_its_own_shape() -> None:
    exc = ModelNotFound("model 'x' not found")
    assert format_error(exc) == (404, {"error": "model 'x' not found"})
    status, body = format_error(exc, Shape.OPENAI)
    assert status == 404 and body["error"] == {"message": "model 'x' not found",
                                               "type": "not_found_error", "param": None,
                                               "code": None}
    assert format_error(exc, Shape.TEXT) == (404, "model 'x' not found")
    assert format_error(Forbidden("forbidden")) == (403, None)


def test_unknown_exceptions_never_leak_details() -> None:
    assert format_error(KeyError("secret path /etc/x")) == (500, {"error": "internal server error"})


@pytest.mark.parametrize("exc", [BadRequest("b"), ContextOverflow("too long"), InvalidDigest(),
                                 ModelNotFound("m"), ServerBusy("busy"), RunnerError("dead")])
def test_types_survive_the_runner_boundary(exc: CorralError) -> None:
    status, body = format_error(exc, Shape.RUNNER)
    back = from_wire(status, body)
    assert type(back) is type(exc) and back.message == exc.message and back.status == status
    line = from_wire(None, body)  # an error line inside a stream carries no status
    assert type(line) is type(exc)


def test_an_unknown_kind_falls_back_by_status() -> None:
    assert type(from_wire(400, {"error": "x", "kind": "Nope"})) is BadRequest
    assert type(from_wire(500, {"error": "x", "kind": "Nope"})) is RunnerError
    assert type(from_wire(502, "not json")) is RunnerError
