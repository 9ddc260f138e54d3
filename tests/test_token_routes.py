"""The token routes without a model: their errors in each API's shape, and the pure
pieces (llama-server's piece format, the newest `think` and `reasoning_effort` values, the
embeddings' `truncate`). The counts themselves are checked against real evaluations in
tests/test_tokens.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.api.wire import parse
from corral.api.wire.native import ChatRequest
from corral.api.wire.openai import EmbeddingRequest
from corral.errors import BadRequest, CorralError
from corral.runner.wire import TokenPiece
from corral.server.daemon import Daemon
from corral.server.dialects.openai import think_of_effort


def post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=60)


def test_a_piece_is_text_or_its_bytes() -> None:
    assert TokenPiece.of(7, "é".encode()) == TokenPiece(7, "é")
    assert TokenPiece.of(8, b"\xf0\x9f") == TokenPiece(8, [0xF0, 0x9F])  # half a character


def test_max_is_high_and_none_is_off() -> None:
    assert parse(ChatRequest, {"model": "m", "think": "max"}).think == "high"
    assert parse(ChatRequest, {"model": "m", "think": "MAX"}).think == "high"
    assert think_of_effort("max") == "high" and think_of_effort("none") is False
    with pytest.raises(BadRequest, match="invalid reasoning value"):
        think_of_effort("xhigh")


def test_the_cli_sends_max() -> None:
    from corral.cli.main import _think_flag

    assert _think_flag("max") == "max" and _think_flag("MAX") == "max"
    with pytest.raises(CorralError, match="high or max"):
        _think_flag("ultra")


def test_openai_embeddings_take_truncate() -> None:
    assert parse(EmbeddingRequest, {"input": "x"}).truncate is True
    assert parse(EmbeddingRequest, {"input": "x", "truncate": False}).truncate is False
    with pytest.raises(BadRequest, match="truncate"):
        parse(EmbeddingRequest, {"input": "x", "truncate": "no"})


UNKNOWN = "no-such-model"


def test_unknown_models_and_bad_bodies_in_each_apis_shape(tmp_path: Path) -> None:
    from tests.support import start_daemon

    d = start_daemon(None, tmp_path)  # no models: nothing here loads one
    try:
        shapes = {
            "/api/tokenize": ({"model": UNKNOWN, "content": "x"}, "ollama"),
            "/api/detokenize": ({"model": UNKNOWN, "tokens": [1]}, "ollama"),
            "/tokenize": ({"model": UNKNOWN, "content": "x"}, "openai"),
            "/detokenize": ({"model": UNKNOWN, "tokens": [1]}, "openai"),
            "/v1/messages/count_tokens": ({"model": UNKNOWN, "messages": [
                {"role": "user", "content": "x"}]}, "anthropic"),
            "/v1/responses/input_tokens": ({"model": UNKNOWN, "input": "x"}, "openai"),
        }
        for path, (body, shape) in shapes.items():
            r = post(d, path, body)
            assert r.status_code == 404, (path, r.text)
            assert error_message(r.json(), shape) == f"model '{UNKNOWN}' not found", path
        r = post(d, "/tokenize", {"content": "x"})
        assert r.status_code == 400 and "model is required" in r.json()["error"]["message"]
        r = post(d, "/api/tokenize", {"content": "x"})
        assert r.status_code == 400 and r.json() == {"error": "model is required"}
        r = post(d, "/api/detokenize", {"model": UNKNOWN, "tokens": ["a"]})
        assert r.status_code == 400 and "tokens.0" in r.json()["error"]
        r = post(d, "/v1/messages/count_tokens", {"model": UNKNOWN, "messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error"
    finally:
        d.shutdown()


def error_message(body: Any, shape: str) -> str:
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        return str(body["error"]["message"])
    if shape == "openai":
        assert body["error"]["type"] == "not_found_error"
        return str(body["error"]["message"])
    return str(body["error"])
