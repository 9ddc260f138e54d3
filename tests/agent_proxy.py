"""A loopback proxy in front of the daemon that keeps what an agent sent and what it got.

The network test runs the agents through it to see that no request got a 4xx; run as a
script it records an agent's requests, which is how tests/peers/agents/ was made:

    python -m tests.agent_proxy 18080 127.0.0.1:11434 /tmp/recorded
    ANTHROPIC_BASE_URL=http://127.0.0.1:18080 claude -p "Say hi" --model agent

(tests/peers/SOURCES.md says what was kept of each request, and what was blanked.)
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    status: int = 0


class AgentProxy:
    """Forwards to `upstream` ("host:port"), streaming answers through as they come."""

    def __init__(self, upstream: str, out: Path | None = None, port: int = 0) -> None:
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy, host, up_port = self, *upstream.rsplit(":", 1)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw.strip().startswith(b"{") else None
                seen = Exchange(self.command, self.path, dict(self.headers), body)
                with proxy._lock:
                    proxy.exchanges.append(seen)
                    n = len(proxy.exchanges)
                conn = http.client.HTTPConnection(host, int(up_port), timeout=900)
                conn.request(self.command, self.path, body=raw, headers={
                    k: v for k, v in self.headers.items() if k.lower() not in HOP})
                resp = conn.getresponse()
                seen.status = resp.status
                if out is not None:
                    name = self.path.strip("/").split("?")[0].replace("/", "_")
                    (out / f"{n:03d}-{self.command}-{name}.json").write_text(
                        json.dumps(seen.__dict__, indent=1))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                if self.command == "HEAD":
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    conn.close()
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(1 << 16):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                conn.close()

            do_GET = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def refused(self) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.status >= 400]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    folder = Path(sys.argv[3])
    folder.mkdir(parents=True, exist_ok=True)
    AgentProxy(sys.argv[2], folder, int(sys.argv[1]))
    threading.Event().wait()  # until interrupted
