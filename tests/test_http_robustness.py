"""The HTTP layer against hostile and broken clients, with no model loaded (level 2).

Every finding of the adversarial run that needs no model is here: malformed
HTTP at the socket level, chunked bodies, slow headers, early hang-ups, wrong
shapes, long names, racing deletes, and limits; plus a fuzzer of JSON bodies
for every route.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.server.daemon import Daemon
from tests.gguf_files import write_tiny_gguf
from tests.support import DaemonFactory, wait_for


@pytest.fixture
def bare(daemon_factory: DaemonFactory) -> Daemon:
    return daemon_factory(None, HEADER_TIMEOUT="1s", MAX_CREATE_FILES="64", MAX_EMBED_INPUTS="100")


def raw(d: Daemon, data: bytes, read: bool = True) -> bytes:
    host, port = d.address
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            chunks.append(part)
            if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                break
        return b"".join(chunks)


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return head.startswith(b"HTTP/1.1 4") and body.endswith(b"\r\n0\r\n\r\n")


def status_and_json(response: bytes) -> tuple[int, Any]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def upload_tiny(d: Daemon, tmp: Path) -> str:
    data = write_tiny_gguf(tmp / "tiny.gguf").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{d.url}/api/blobs/{digest}", content=data).status_code == 201
    return digest


def test_bad_content_length_is_a_400_in_our_shape(bare: Daemon) -> None:
    status, body = status_and_json(raw(bare, b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                             b"Content-Length: abc\r\n\r\n"))
    assert status == 400 and "malformed request" in body["error"]
    assert httpx.get(bare.url + "/").status_code == 200


def test_chunked_json_body_is_read_and_the_connection_stays_in_step(bare: Daemon) -> None:
    body = b'{"model": "nope"}'
    request = (b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    host, port = bare.address
    with socket.create_connection((host, port), timeout=10) as s:
        for _ in range(2):  # the same connection answers twice: nothing was left unread
            s.sendall(request)
            data = b""
            while not _complete(data):  # each recv times out after 10 s
                part = s.recv(65536)
                assert part, data  # closed before the answer was whole
                data += part
            status, payload = status_and_json(data)
            assert status == 404 and payload == {"error": "model 'nope:latest' not found"}


def test_chunked_blob_upload(bare: Daemon, tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    r = httpx.post(f"{bare.url}/api/blobs/{digest}", content=pieces())  # chunked: no length
    assert r.status_code == 201
    assert httpx.head(f"{bare.url}/api/blobs/{digest}").status_code == 200


def test_slow_headers_cannot_hold_connections(bare: Daemon) -> None:
    host, port = bare.address
    slow = [socket.create_connection((host, port)) for _ in range(50)]
    try:
        for s in slow:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert httpx.get(bare.url + "/", timeout=5).text == "Corral is running"
        for s in slow:  # closed by the server once HEADER_TIMEOUT (1 s here) passed
            s.settimeout(10)
            assert s.recv(1) == b""
    finally:
        for s in slow:
            s.close()


def test_early_hang_ups_leave_the_daemon_serving(bare: Daemon) -> None:
    raw(bare, b"POST /api/show HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{\"mo",
        read=False)
    raw(bare, b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n", read=False)
    assert httpx.get(bare.url + "/api/tags").json() == {"models": []}


@pytest.mark.parametrize("method,path,status,text", [
    ("PATCH", "/api/tags", 405, "405 method not allowed"),
    ("GET", "/api/nope", 404, "404 page not found"),
])
def test_unknown_routes_and_methods(bare: Daemon, method: str, path: str, status: int,
                                    text: str) -> None:
    r = httpx.request(method, bare.url + path)
    assert (r.status_code, r.text) == (status, text)


@pytest.mark.parametrize("path,body,status,message", [
    ("/api/pull", {"model": "bad name!"}, 400, "invalid model name"),
    ("/api/generate", {"model": 5}, 400, "model: Input should be a valid string"),
    ("/api/show", {"model": "\ud800"}, 400, "invalid model name"),
    ("/api/show", {"model": "h" * 300 + "/ns/m:t"}, 400, "invalid model name"),
    ("/api/create", {"model": "h" * 300 + "/ns/m:t", "from": "x"}, 400, "invalid model name"),
    # Management bodies are typed records too: a wrong type names its field.
    ("/api/pull", {"model": "m", "insecure": "yes"}, 400, "insecure: Input should be a valid"),
    ("/api/push", {"model": "m", "stream": "no"}, 400, "stream: Input should be a valid"),
    ("/api/show", {"model": "m", "verbose": 1}, 400, "verbose: Input should be a valid"),
    ("/api/copy", {"source": 5, "destination": "b"}, 400, "source: Input should be a valid"),
    ("/api/copy", {"source": "", "destination": "b"}, 400, 'source "" is invalid'),
    ("/api/show", {"name": ["m"]}, 400, "name: Input should be a valid"),
    ("/api/create", {"model": "m", "files": ["x"]}, 400, "files: Input should be a valid"),
    ("/api/create", {"model": "m", "quantize": 4}, 400, "quantize: Input should be a valid"),
    ("/corral/render", {"model": "m", "prompt": "x", "chat_template": 1}, 400,
     "chat_template: Input should be a valid"),
])
def test_client_errors_are_4xx_with_a_message(bare: Daemon, path: str, body: dict[str, Any],
                                              status: int, message: str) -> None:
    r = httpx.post(bare.url + path, content=json.dumps(body))
    assert r.status_code == status and message in r.json()["error"]


def test_v1_errors_use_openai_shape(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(None, API_KEY="k")
    r = httpx.post(d.url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "unauthorized" and "type" in r.json()["error"]
    native = httpx.post(d.url + "/api/chat", json={"model": "m"})
    assert native.status_code == 401 and native.json() == {"error": "unauthorized"}
    keyed = httpx.post(d.url + "/v1/chat/completions", headers={"x-api-key": "k"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert keyed.status_code == 404 and keyed.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}),
    ("/v1/responses", {"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "7"}]}),
])
def test_call_arguments_that_are_not_an_object_are_a_400(bare: Daemon, path: str,
                                                         body: dict[str, Any]) -> None:
    # A call's arguments reach templates as a mapping: anything else is refused at the edge.
    r = httpx.post(bare.url + path, json=body)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_create_limits_and_one_inspection_per_blob(bare: Daemon, tmp_path: Path) -> None:
    digest = upload_tiny(bare, tmp_path)
    many = {f"f{i}.gguf": digest for i in range(10_000)}
    r = httpx.post(bare.url + "/api/create", json={"model": "m", "files": many, "stream": False})
    assert r.status_code == 400 and "CORRAL_MAX_CREATE_FILES" in r.json()["error"]
    ok = {f"f{i}.gguf": digest for i in range(64)}
    r = httpx.post(bare.url + "/api/create", json={"model": "m", "files": ok, "stream": False},
                   timeout=30)
    assert r.status_code == 200


def test_embed_input_limit(bare: Daemon, tmp_path: Path) -> None:
    digest = upload_tiny(bare, tmp_path)
    httpx.post(bare.url + "/api/create", json={"model": "m", "files": {"t.gguf": digest},
                                                "stream": False})
    r = httpx.post(bare.url + "/api/embed", json={"model": "m", "input": ["hi"] * 5000})
    assert r.status_code == 400 and "CORRAL_MAX_EMBED_INPUTS" in r.json()["error"]


def test_racing_create_copy_delete_never_fail_the_server(bare: Daemon, tmp_path: Path) -> None:
    digest = upload_tiny(bare, tmp_path)
    statuses: list[int] = []

    def worker(i: int) -> None:
        with httpx.Client(base_url=bare.url, timeout=30) as c:
            for j in range(10):
                op = (i + j) % 3
                if op == 0:
                    r = c.post("/api/create", json={"model": "race", "stream": False,
                                                    "files": {"t.gguf": digest}})
                elif op == 1:
                    r = c.post("/api/copy", json={"source": "race", "destination": "race2"})
                else:
                    r = c.request("DELETE", "/api/delete", json={"model": "race"})
                statuses.append(r.status_code)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 40 and all(s < 500 for s in statuses), statuses


ROUTES = [("POST", "/api/generate"), ("POST", "/api/chat"), ("POST", "/api/embed"),
          ("POST", "/api/embeddings"), ("POST", "/api/show"), ("POST", "/api/create"),
          ("POST", "/api/copy"), ("DELETE", "/api/delete"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/api/tags"),
          ("GET", "/api/ps"), ("GET", "/v1/models")]  # not pull or push: they would leave loopback
KEYS = ["model", "name", "prompt", "messages", "options", "stream", "format", "input", "files",
        "from", "source", "destination", "keep_alive", "think", "tools", "system", "template",
        "raw", "suffix", "context", "images", "truncate", "modelfile", "parameters", "stop",
        "max_tokens", "temperature", "response_format", "encoding_format", "quantize"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() |
                    st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    from tests.support import start_daemon

    root = tmp_path_factory.mktemp("fuzz")
    d = start_daemon(None, root)
    yield d, root
    d.shutdown()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=st.dictionaries(st.sampled_from(KEYS), JSON,
                                                           max_size=6))
def test_fuzzed_bodies_never_get_a_5xx(fuzzed: tuple[Daemon, Path], route: tuple[str, str],
                                       body: dict[str, Any]) -> None:
    d, root = fuzzed
    before = {p for p in root.parent.rglob("*") if root not in p.parents and p != root}
    data = json.dumps(body, allow_nan=True).encode()
    r = httpx.request(route[0], d.url + route[1], content=data, timeout=30)
    assert r.status_code < 500, (route, body, r.text)
    after = {p for p in root.parent.rglob("*") if root not in p.parents and p != root}
    assert after == before  # nothing written outside the daemon's own folder
    assert httpx.get(d.url + "/").status_code == 200


def test_a_client_that_leaves_gets_no_traceback_logged(bare: Daemon,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="corral"):
        for _ in range(5):
            raw(bare, b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", read=False)

        def left() -> int:
            return sum(r.getMessage() == "client left GET /api/tags" for r in caplog.records)
        # Every request logs its client's leaving once; with all five logged and no request
        # task left running, whatever they were going to log is in.
        wait_for(lambda: left() == 5 and not bare.http.server.server_state.tasks)
        assert httpx.get(bare.url + "/").status_code == 200
    assert not any(r.exc_info for r in caplog.records)
