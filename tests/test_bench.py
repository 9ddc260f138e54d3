"""Benchmark metrics on synthetic streams with known timings, and one real short run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from corral.cli.bench import BenchConfig, send
from corral.cli.benchmetrics import (
    RequestResult,
    Summary,
    calculate,
    peak_concurrency,
    percentile,
)
from corral.registry.store import Store
from tests.support import DaemonFactory


def synthetic(start: float, ttft: float, gaps: list[float], tokens: int) -> RequestResult:
    times = [start + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(start=start, chunk_times=times, end=times[-1], output_tokens=tokens,
                         prompt_tokens=10, server_eval_count=tokens,
                         server_eval_ns=int(sum(gaps) * 1e9), server_prompt_count=10,
                         server_prompt_ns=int(ttft * 1e9))


def test_per_request_metrics() -> None:
    r = synthetic(0.0, 0.5, [0.1, 0.1, 0.2], 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.1, 0.2])
    assert r.e2e == pytest.approx(0.9)
    assert r.tpot == pytest.approx((0.9 - 0.5) / 3)
    assert synthetic(0.0, 0.5, [], 1).tpot is None


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_aggregates_and_json_round_trip(tmp_path: Path) -> None:
    results = [synthetic(0.0, 0.2, [0.1] * 9, 10), synthetic(0.5, 0.4, [0.2] * 9, 10),
               synthetic(3.0, 0.3, [0.1] * 4, 5),
               RequestResult(start=1.0, end=1.5, success=False, error="boom")]
    s = calculate("2", results, duration=4.0)
    assert (s.completed, s.failed, s.output_tokens) == (3, 1, 25)
    assert s.request_throughput == pytest.approx(3 / 4.0)
    assert s.output_throughput == pytest.approx(25 / 4.0)
    assert s.ttft["median"] == pytest.approx(0.3) and s.ttft["mean"] == pytest.approx(0.3)
    assert s.itl["median"] == pytest.approx(0.1)  # token-weighted: 13 gaps of 0.1, 9 of 0.2
    assert s.tpot["mean"] == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert s.peak_concurrency == 2
    assert s.server_decode_rate == pytest.approx((10 / 0.9 + 10 / 1.8 + 5 / 0.4) / 3)
    again = Summary.from_json(json.loads(json.dumps(s.to_json())))
    assert again == s


def test_peak_concurrency_counts_overlaps() -> None:
    rs = [RequestResult(start=0, end=2), RequestResult(start=1, end=3),
          RequestResult(start=2, end=4), RequestResult(start=2.5, end=2.6)]
    assert peak_concurrency(rs) == 3


def test_real_short_run(starter_store: Store, daemon_factory: DaemonFactory,
                        tmp_path: Path) -> None:
    d = daemon_factory(starter_store)
    out_json = tmp_path / "bench.json"
    env = dict(os.environ, CORRAL_HOST="127.0.0.1:1")
    run = subprocess.run(
        [sys.executable, "-c", "from corral.cli.main import main; main()", "bench",
         "gemma3:270m-base", "--base-url", d.url, "--concurrency", "1,2", "--requests", "2",
         "--max-tokens", "6", "--prompt-tokens", "8", "--json", str(out_json)],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    levels = json.loads(out_json.read_text())["levels"]
    assert [lv["label"] for lv in levels] == ["1", "2"]
    for lv in levels:
        assert lv["completed"] == 2 and lv["failed"] == 0
        assert lv["output_tokens"] == 2 * 6  # exactly max_tokens each
        assert lv["ttft"]["median"] > 0 and lv["server_decode_rate"] > 0
    assert "out tok/s" in run.stdout


class _Stale(BaseHTTPRequestHandler):
    """An OpenAI-style streaming server that answers the first request on a connection
    and drops any later one unanswered, as a server that closed the connection after its
    reply does when the client's next request was already on the way (`answers`: False,
    it answers none at all)."""

    protocol_version = "HTTP/1.1"
    answers = True
    received: list[str] = []
    REPLY = (b'data: {"choices":[{"text":"Hi"}]}\n\n'
             b'data: {"choices":[{"text":"!"}],"usage":{"completion_tokens":2,'
             b'"prompt_tokens":3}}\n\ndata: [DONE]\n\n')

    def setup(self) -> None:
        super().setup()
        self.count = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append(self.path)
        self.count += 1
        if self.count > 1 or not self.answers:
            self.close_connection = True  # the socket closes with nothing sent
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(self.REPLY)))
        self.end_headers()
        self.wfile.write(self.REPLY)


@pytest.mark.parametrize("answers", [True, False])
def test_a_request_on_a_closed_connection_is_sent_again_once(answers: bool) -> None:
    handler = type("Handler", (_Stale,), {"answers": answers, "received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = BenchConfig(model="m", base_url=url, api="openai", max_tokens=2)
        with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as http:
            results = [send(http, cfg, "hello", None, seed=1) for _ in range(2)]
    finally:
        server.shutdown()
        server.server_close()
    if answers:  # the second request's connection was dropped: it went again, on a new one
        assert [(r.success, r.output_tokens, text) for r, text in results] == [
            (True, 2, "Hi!"), (True, 2, "Hi!")]
        assert len(handler.received) == 3
    else:  # never answered: each request tried twice, then failed
        assert [r.success for r, _ in results] == [False, False]
        assert "disconnected" in results[0][0].error.lower()
        assert len(handler.received) == 4
