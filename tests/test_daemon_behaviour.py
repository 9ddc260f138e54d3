"""The real daemon under load and faults: queue limit, keep-alive, disconnects, crashes,
and the protections (Host check, CORS, API key, body limit, option ranges)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import DaemonFactory, wait_for

MODEL = "gemma3:270m-base"


def post(d: Daemon, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120, **kw)


def ps_names(d: Daemon) -> list[str]:
    return [m["name"] for m in httpx.get(d.url + "/api/ps").json()["models"]]


# A request that cannot end on its own: no length limit and no end of text (the context
# shifts). It holds its slot, or its place in the queue, until its client leaves.
ENDLESS = {"temperature": 0, "num_predict": -1, "ignore_eos": True}


class Held:
    """A streaming request in a thread, read until `stop()`, which closes it."""

    def __init__(self, d: Daemon, prompt: str = "Once upon a time", **body: Any) -> None:
        self.status: int | None = None
        self.lines: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._body = {"model": MODEL, "prompt": prompt, "raw": True, "options": ENDLESS, **body}
        self._thread = threading.Thread(target=self._read, args=(d,), daemon=True)
        self._thread.start()

    def _read(self, d: Daemon) -> None:
        with httpx.stream("POST", d.url + "/api/generate", json=self._body,
                          timeout=120) as resp:
            self.status = resp.status_code
            for raw in resp.iter_lines():
                self.lines.append(json.loads(raw))
                if self._stop.is_set():
                    return

    def release(self) -> None:
        """Close the stream at its next line, without waiting for that."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the held stream never closed"


def ps_entry(d: Daemon) -> dict[str, Any]:
    [entry] = [m for m in httpx.get(d.url + "/api/ps").json()["models"] if m["name"] == MODEL]
    return dict(entry)


def test_queue_overflow(starter_store: Store, daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NUM_PARALLEL="2", MAX_QUEUE="3")
    assert post(d, "/api/generate", {"model": MODEL}).json()["done_reason"] == "load"
    running = [Held(d) for _ in range(2)]
    wait_for(lambda: ps_entry(d)["slots_busy"] == 2, timeout=60)
    queued = [Held(d) for _ in range(3)]
    wait_for(lambda: metric(d, "corral_queue_depth") == 3, timeout=60)
    # Both slots and the whole queue are taken, by requests that cannot end: every
    # further request is refused, however fast this machine decodes.
    busy = [post(d, "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                      "options": {"num_predict": 1}}) for _ in range(4)]
    assert ps_entry(d)["slots_busy"] == 2 and metric(d, "corral_queue_depth") == 3
    # Released all at once: which queued request the runner starts first is its own
    # choice (they reach it in any order), and each runs until it is released.
    for held in running + queued:
        held.release()
    for held in running + queued:
        held.stop()
    assert all(r.status_code == 503 and r.headers.get("retry-after") for r in busy)
    assert all(r.json() == {"error": "server busy, please try again.  maximum pending "
                                     "requests exceeded"} for r in busy)
    assert [h.status for h in running + queued] == [200] * 5
    assert all(not line.get("done") and "error" not in line for h in running for line in h.lines)


def test_keep_alive_zero_unloads(daemon: Daemon) -> None:
    post(daemon, "/api/generate", {"model": MODEL, "prompt": "Hi",
                                   "options": {"num_predict": 2}, "stream": False})
    assert MODEL in ps_names(daemon)
    r = post(daemon, "/api/generate", {"model": MODEL, "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    wait_for(lambda: MODEL not in ps_names(daemon))


def test_short_keep_alive_never_fires_while_streaming(daemon: Daemon) -> None:
    held = Held(daemon, keep_alive="1s")
    wait_for(lambda: len(held.lines) > 0, timeout=60)
    # The stream cannot end on its own. The keep-alive pass, run now as if twice the
    # keep-alive had passed, leaves the busy model loaded: synchronously, so it is the
    # pass under test that left it, not a timer thread that may not have run yet.
    daemon.scheduler.expire_once(time.time() + 2.0)
    assert MODEL in ps_names(daemon)  # still loaded, twice its keep-alive into the stream
    count = len(held.lines)
    wait_for(lambda: len(held.lines) > count, timeout=30)  # and still streaming
    held.stop()
    assert not any(line.get("done") or "error" in line for line in held.lines)
    wait_for(lambda: MODEL not in ps_names(daemon), timeout=10)  # the timer starts now


def greedy(d: Daemon, n: int = 20) -> str:
    r = post(d, "/api/generate", {"model": MODEL, "prompt": "The history of bread",
                                  "raw": True, "stream": False,
                                  "options": {"temperature": 0, "num_predict": n}})
    return str(r.json()["response"])


def busy_slots(d: Daemon) -> float:
    text = httpx.get(d.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith("corral_busy_slots{"):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_frees_the_slot(daemon_factory: Any, starter_store: Store) -> None:
    # Batch-invariant kernels: the greedy answer after drafts from the requests before
    # it is then bit for bit the one before (docs/api.md, speculative decoding).
    daemon = daemon_factory(starter_store, DETERMINISTIC="1")
    expected = greedy(daemon)
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "raw": True,
                       "options": {"temperature": 0, "num_predict": 2000}}).encode()
    host, port = daemon.address
    with socket.create_connection((host, port), timeout=60) as sock:  # each recv: 60 s
        sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while received.count(b'"response"') < 3:
            part = sock.recv(4096)
            assert part, received  # closed before three tokens came
            received += part
    wait_for(lambda: busy_slots(daemon) == 0, timeout=10)
    assert greedy(daemon) == expected


def test_runner_crash_mid_stream(daemon: Daemon) -> None:
    greedy(daemon, 2)
    [entry] = daemon.scheduler.running()
    pid = entry.runner.pid  # type: ignore[union-attr]
    body = {"model": MODEL, "prompt": "Once upon a time", "raw": True,
            "options": {"temperature": 0, "num_predict": 3000}}
    lines = []
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=60) as resp:
        for raw in resp.iter_lines():
            lines.append(json.loads(raw))
            if len(lines) == 3:
                os.kill(pid, signal.SIGKILL)
    assert "error" in lines[-1] and not lines[-1].get("done")
    assert greedy(daemon, 4)  # the next request loads a fresh runner


@pytest.mark.parametrize("host", ["evil.example.com", "attacker.com:11434", "1.2.3.4.nip.io"])
def test_host_check(daemon: Daemon, host: str) -> None:
    assert httpx.get(daemon.url + "/api/tags", headers={"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["localhost:11434", "127.0.0.1", "[::1]:80", "box.local"])
def test_local_hosts_pass(daemon: Daemon, host: str) -> None:
    assert httpx.get(daemon.url + "/api/tags", headers={"Host": host}).status_code == 200


def test_cors(daemon: Daemon) -> None:
    ok = httpx.get(daemon.url + "/api/tags", headers={"Origin": "http://localhost:3000"})
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    for origin in ("app://obsidian.md", "vscode-webview://abc", "tauri://localhost"):
        r = httpx.get(daemon.url + "/api/tags", headers={"Origin": origin})
        assert r.headers.get("access-control-allow-origin") == origin
    bad = httpx.get(daemon.url + "/api/tags", headers={"Origin": "https://evil.example"})
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
    pre = httpx.options(daemon.url + "/api/chat", headers={
        "Origin": "http://127.0.0.1:8080", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]


def test_extra_origins(starter_store: Store, daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, ORIGINS="chrome-extension://*")
    r = httpx.get(d.url + "/api/tags", headers={"Origin": "chrome-extension://abc"})
    assert r.headers["access-control-allow-origin"] == "chrome-extension://abc"


def test_api_key(starter_store: Store, daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, API_KEY="s3cret")
    assert httpx.get(d.url + "/").status_code == 200
    assert httpx.head(d.url + "/").status_code == 200
    assert httpx.get(d.url + "/api/tags").status_code == 401
    wrong = httpx.get(d.url + "/api/tags", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json() == {"error": "unauthorized"}
    right = httpx.get(d.url + "/api/tags", headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200


def test_body_limit(daemon: Daemon) -> None:
    big = b'{"model":"' + b"x" * (17 << 20) + b'"}'
    r = httpx.post(daemon.url + "/api/generate", content=big, timeout=60)
    assert r.status_code == 413 and "error" in r.json()
    assert httpx.get(daemon.url + "/api/version").status_code == 200


@pytest.mark.parametrize("options", [
    {"temperature": "hot"}, {"temperature": -1}, {"temperature": float("nan")},
    {"top_k": -1}, {"num_ctx": 2}, {"num_ctx": 2**31}, {"num_predict": -3},
    {"top_p": 1.5}, {"seed": 2**70}, {"num_thread": 10000}, {"stop": [1, 2]},
])
def test_bad_options_are_400(daemon: Daemon, options: dict[str, Any]) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=60, content=json.dumps(
        {"model": MODEL, "prompt": "x", "options": options}, allow_nan=True))
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("body,status", [
    (b"", 400), (b"not json", 400), (b"[1]", 400), (b'{"model": 5}', 400),
    (b'{"model": "../x", "prompt": "a"}', 400), (b"[" * 100000 + b"]" * 100000, 400),
    (b'{"model": "gemma3:270m-base", "messages": {}}', 400),
    (b'{"model": "gemma3:270m-base", "prompt": "x", "keep_alive": "soon"}', 400),
    (b'{"model": "gemma3:270m-base", "prompt": "x", "format": "yaml"}', 400),
    (b'{"model": "gemma3:270m-base", "prompt": "x", "raw": true, "system": "s"}', 400),
    (b'{"model": "gemma3:270m-base", "prompt": "x", "images": ["aGk="]}', 400),
    (b'{"model": "gemma3:270m-base", "messages": [{"role":"user","content":"x"}], '
     b'"think": true}', 400),
    (b'{"model": "gemma3:270m-base", "messages": [{"role":"user","content":"x"}], '
     b'"tools": [{"type":"function","function":{"name":"f"}}]}', 400),
])
def test_bad_requests(daemon: Daemon, body: bytes, status: int) -> None:
    path = "/api/chat" if b"messages" in body else "/api/generate"
    r = httpx.post(daemon.url + path, content=body, timeout=60)
    assert r.status_code == status and "error" in r.json()


@pytest.mark.parametrize("digest", ["sha256:../../etc/passwd", "sha256-" + "a" * 63,
                                    "sha512:" + "a" * 128, "sha256:" + "A" * 64])
def test_blob_digests(daemon: Daemon, digest: str) -> None:
    assert httpx.head(daemon.url + "/api/blobs/" + digest).status_code == 400
    r = httpx.post(daemon.url + "/api/blobs/" + digest, content=b"data")
    assert r.status_code == 400


def test_blob_upload_verifies(daemon: Daemon) -> None:
    import hashlib

    data = b"some layer"
    good = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.head(daemon.url + "/api/blobs/" + good).status_code == 404
    bad = httpx.post(daemon.url + "/api/blobs/sha256:" + "0" * 64, content=data)
    assert bad.status_code == 400 and "mismatch" in bad.json()["error"]
    assert httpx.post(daemon.url + "/api/blobs/" + good, content=data).status_code == 201
    assert httpx.head(daemon.url + "/api/blobs/" + good).status_code == 200


def test_unknown_path_and_method(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/nope").status_code == 404
    assert httpx.get(daemon.url + "/api/generate").status_code == 405


def test_metrics_format(daemon: Daemon) -> None:
    greedy(daemon, 3)
    text = httpx.get(daemon.url + "/metrics").text
    for family in ("corral_requests_total", "corral_prompt_tokens_total",
                   "corral_generated_tokens_total", "corral_time_to_first_token_seconds_bucket",
                   "corral_time_per_output_token_seconds_count", "corral_queue_depth",
                   "corral_busy_slots", "corral_kv_cells_used", "corral_kv_cells_reserved"):
        assert family in text
    # The whole page parses as Prometheus' text format, with the labels and values it names.
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("corral_requests_total", (("model", MODEL), ("status", "ok")))] >= 1
    ttft = (("le", "+Inf"), ("model", MODEL))
    assert samples[("corral_time_to_first_token_seconds_bucket", ttft)] >= 1
    assert samples[("corral_slots", (("model", MODEL),))] >= 1


def metric(d: Daemon, name: str) -> float:
    for line in httpx.get(d.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if f'model="{MODEL}"' in line or "{" not in line:
                return float(line.split()[-1])
    return 0.0


def test_queued_request_of_a_gone_client_never_runs(starter_store: Store,
                                                    daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NUM_PARALLEL="1")
    post(d, "/api/generate", {"model": MODEL})  # load
    holder = Held(d)  # holds the only slot until it is stopped
    wait_for(lambda: busy_slots(d) == 1, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "queued", "raw": True,
                       "options": {"num_predict": 50}}).encode()
    host, port = d.address
    with socket.create_connection((host, port)) as sock:  # queued behind the holder...
        sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
                     b"%d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: metric(d, "corral_queue_depth") == 1, timeout=60)
    # ...and gone before its turn: it leaves the queue while the holder still has the
    # only slot, so it was dropped, never run.
    wait_for(lambda: metric(d, "corral_queue_depth") == 0, timeout=30)
    assert busy_slots(d) == 1 and holder.status == 200
    # The holder still streams: 100 tokens, more than the queued request's 50 could leave
    # in the slot. A deadline, not a rate: two suites side by side on two cores have
    # streamed under one token a second here.
    wait_for(lambda: len(holder.lines) > 100, timeout=900)
    holder.stop()
    wait_for(lambda: busy_slots(d) == 0, timeout=30)
    assert metric(d, "corral_queue_depth") == 0
    # The only slot still caches the holder's prompt and 100+ tokens, not the queued
    # prompt and its 50.
    assert metric(d, "corral_kv_cells_used") > 100


def test_oversized_prompt_without_truncation_is_a_client_error(daemon: Daemon) -> None:
    r = post(daemon, "/api/generate", {"model": MODEL, "prompt": "word " * 3000, "stream": False,
                                       "truncate": False, "options": {"num_predict": 2}})
    assert r.status_code == 400 and "exceeds the context length" in r.json()["error"]


def test_a_lone_surrogate_in_a_prompt_is_answered(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=120, content=json.dumps(
        {"model": MODEL, "prompt": "\ud800 x", "stream": False, "options": {"num_predict": 2}}))
    assert r.status_code == 200 and r.json()["eval_count"] == 2


def test_a_large_embed_batch_stops_when_its_client_leaves(daemon: Daemon) -> None:
    post(daemon, "/api/generate", {"model": MODEL})  # loaded
    body = json.dumps({"model": MODEL, "input": ["a fairly long sentence to embed " * 8] * 2000})
    host, port = daemon.address
    with socket.create_connection((host, port)) as s:
        s.sendall(f"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        wait_for(lambda: metric(daemon, "corral_queue_depth") > 0, timeout=30)
    # 2000 inputs take minutes here; the runner drops the batch at its next slice instead
    # (a deadline, not a measure: a slice takes seconds on a busy two-core machine).
    wait_for(lambda: metric(daemon, "corral_queue_depth") == 0, timeout=60)
    quick = post(daemon, "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                           "options": {"num_predict": 2}})
    assert quick.status_code == 200


def test_delete_of_a_streaming_model_answers_before_the_stream_ends(daemon: Daemon) -> None:
    assert post(daemon, "/api/copy", {"source": MODEL, "destination": "doomed"}).is_success
    body = {"model": "doomed", "prompt": "Once upon a time", "raw": True,
            "options": {"num_predict": 300, "ignore_eos": True}}
    lines: list[dict[str, Any]] = []
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=300) as resp:
        stream = resp.iter_lines()
        lines.append(json.loads(next(stream)))
        deleted = httpx.request("DELETE", daemon.url + "/api/delete", timeout=300,
                                json={"model": "doomed"})
        assert deleted.status_code == 200
        answered = time.time()
        lines += [json.loads(line) for line in stream]
    # The answer came while the stream was still going, and the stream went on to its end.
    import datetime as dt

    ended = dt.datetime.fromisoformat(lines[-1]["created_at"][:26] + "+00:00").timestamp()
    assert answered < ended
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 300 and len(lines) > 2
    names = [m["name"] for m in httpx.get(daemon.url + "/api/tags").json()["models"]]
    assert "doomed:latest" not in names and MODEL in names  # the shared blobs stay
    wait_for(lambda: "doomed:latest" not in ps_names(daemon))  # unloaded once idle
    assert post(daemon, "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 2}}).is_success
