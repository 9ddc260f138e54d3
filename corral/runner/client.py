"""The daemon's side of a runner process: start it, talk to it, notice when it dies.

Every call has a deadline. Control calls have their own few seconds. A completion or an
embedding has none on the socket, since a long prompt may rightly take minutes before its
first token on a CPU: its deadline is the scheduler's health watch, which kills a runner
that answers no health check for CORRAL_RUNNER_TIMEOUT, and so ends its streams."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, Iterator

from corral.process import package_parent
from corral.errors import CorralError, EngineFailed, RunnerError, from_wire
from corral.runner.loadconfig import LoadConfig
from corral.runner.rankwire import Ranked, RerankJob
from corral.runner.wire import (Cancel, CompletionJob, Counted, DoneLine, EmbedJob, Embeddings,
                               Health, LoadReport, Threads, TokenLine, Tokenize, read_line)

if TYPE_CHECKING:
    import httpx


# How long an unloading runner with a disk tier may take to write its prompt cache there.
DISK_FLUSH_WAIT = 60.0
CONTROL_DEADLINE = 2.0  # /threads, /cache/clear, /cancel, /shutdown: a note, not work
CALL_DEADLINE = 30.0  # /tokenize, /detokenize, /count: work, but bounded by one text
# How long a runner whose engine failed is given to exit by itself before it is killed:
# it waits up to 5 s (runner.process.main STREAM_DRAIN) for its streams' error lines.
FAILED_EXIT = 10.0


def _httpx() -> ModuleType:
    """httpx, imported once the first runner is spawned: its import takes a tenth of a
    second, which a cold `corral run` would otherwise wait for before the model loads."""
    import httpx

    return httpx


LAST_WORDS = 4  # stderr lines of a runner that died during its load, in the load's error


class StderrTail:
    """A runner's stderr, passed on to the daemon's runner log (if any) line by line, with
    its last lines kept: a runner that dies during its load (llama.cpp's abort on a file
    it cannot take) is reported with its own last words, not 'no ready signal'."""

    def __init__(self, stream: IO[bytes], log_file: IO[bytes] | None) -> None:
        self.lines: deque[str] = deque(maxlen=LAST_WORDS)
        self._thread = threading.Thread(target=self._pump, args=(stream, log_file),
                                        daemon=True, name="runner-stderr")
        self._thread.start()

    def _pump(self, stream: IO[bytes], log_file: IO[bytes] | None) -> None:
        """Read to the end whatever the log does: a pipe nobody reads fills, and then the
        runner blocks on its next line to stderr."""
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(stream.readline, b""):
                if log_file is not None:
                    try:
                        log_file.write(raw)
                        log_file.flush()
                    except (OSError, ValueError):  # a full disk, a closed log: lines go
                        log_file = None
                text = raw.decode("utf-8", "replace").strip()
                if text:
                    self.lines.append(text[:500])
            stream.close()

    def last_words(self, wait: float = 2.0) -> str:
        """The last lines, once the stream ended (or `wait` seconds passed)."""
        self._thread.join(wait)
        return " | ".join(self.lines)


def _rest(lines: Iterator[str]) -> None:
    """What follows a stream's end line: its last chunk, which came in the same write. Read
    so that the kept-alive connection goes back to the pool; one that fails is dropped."""
    with contextlib.suppress(Exception):
        for _ in lines:
            pass


class RunnerProcess:
    def __init__(self, config: LoadConfig, log_file: IO[bytes] | None = None,
                 python: str = sys.executable) -> None:
        self.config = config
        self.log_file = log_file
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.report = LoadReport()
        self._http: httpx.Client | None = None
        self._failed = False  # its engine failed (errors.EngineFailed): it is on its way out
        self._streams = 0  # completions being read: `end` lets them read their last lines
        self._streamed = threading.Condition()
        self._stderr: StderrTail | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float) -> LoadReport:
        """Start the process and wait for its ready line; returns the load report."""
        cmd = [self.python, "-m", "corral.runner", "--config", self.config.to_json()]
        root = package_parent()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, cwd=root, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._stderr = StderrTail(self.proc.stderr, self.log_file)
        _httpx()  # while the runner starts
        deadline = None if timeout < 0 else time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self.kill()
                raise RunnerError("timed out waiting for the model to load")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(remaining or 1.0, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                line += chunk
        try:
            message = json.loads(line.decode() or "{}")
        except ValueError:
            message = {}
        if "port" not in message:
            raise RunnerError(f"llama runner process has terminated: {self._died(message)}")
        self.port = int(message["port"])
        self.report = LoadReport.from_json(message.get("report") or {})
        http = _httpx()
        self._http = http.Client(base_url=f"http://127.0.0.1:{self.port}",
                                 timeout=http.Timeout(30.0, read=None), trust_env=False)
        return self.report

    def _died(self, message: dict[str, Any]) -> str:
        """Why a runner ended without its ready line: its own error, else its exit and the
        last lines it wrote (llama.cpp's, where native code aborted)."""
        if message.get("error"):
            self.kill()
            return str(message["error"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)  # type: ignore[union-attr]
        code = self.proc.poll()  # type: ignore[union-attr]
        self.kill()
        words = self._stderr.last_words() if self._stderr is not None else ""
        status = f"exit status {code}" if code is not None else "no ready signal"
        return f"{status}: {words}" if words else status

    def alive(self) -> bool:
        """Running and able to work: a runner whose engine failed counts as dead at once,
        before its process has exited, so the next request loads a fresh one."""
        return self.proc is not None and self.proc.poll() is None and not self._failed

    def _check(self, error: CorralError) -> CorralError:
        if isinstance(error, EngineFailed):
            self._failed = True
        return error

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the runner to end, wait for it, and kill it past `timeout` (a minute at
        least with a disk tier: on its way out it writes its prompt cache there)."""
        if self.alive():
            assert self.proc is not None
            try:
                self._client().post("/shutdown", timeout=CONTROL_DEADLINE)
            except (_httpx().HTTPError, RunnerError):
                # Busy past the request's timeout (a context being made holds the GIL):
                # SIGTERM asks the same, and is read once it can be.
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
            if self.config.cache_disk:
                timeout = max(timeout, DISK_FLUSH_WAIT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close()

    def end(self) -> None:
        """Stop a runner the daemon forgets. One whose engine failed is on its way out by
        itself, once its streams have sent their error lines (runner.process.main waits
        STREAM_DRAIN for them): it gets FAILED_EXIT to go, and the streams being read
        here the same time to read those lines, so that /health, which may tell the daemon
        first, never cuts a stream short of its error. Any other is killed."""
        if self._failed and self.proc is not None:
            deadline = time.monotonic() + FAILED_EXIT
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=FAILED_EXIT)
            with self._streamed:
                self._streamed.wait_for(lambda: self._streams == 0,
                                        timeout=max(deadline - time.monotonic(), 0.0))
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    # ---- requests ----------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            raise RunnerError("runner is not running")
        return self._http

    def _call(self, path: str, body: dict[str, Any],
              timeout: float | None = CALL_DEADLINE) -> dict[str, Any]:
        try:
            resp = self._client().post(path, json=body, timeout=_httpx().Timeout(
                30.0, read=timeout))
        except _httpx().HTTPError as exc:
            raise RunnerError(f"runner process is unreachable: {exc}") from None
        data = resp.json()
        if resp.status_code >= 400:
            raise self._check(from_wire(resp.status_code, data))
        return dict(data)

    def completion(self, job: CompletionJob) -> Iterator[TokenLine | DoneLine]:
        """Stream the runner's lines, typed; ends with a DoneLine or raises RunnerError."""
        with self._streamed:
            self._streams += 1
        try:
            yield from self._lines(job)
        finally:
            with self._streamed:
                self._streams -= 1
                self._streamed.notify_all()

    def _lines(self, job: CompletionJob) -> Iterator[TokenLine | DoneLine]:
        try:
            with self._client().stream("POST", "/completion", json=job.to_json()) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise self._check(from_wire(resp.status_code, resp.json()))
                lines = resp.iter_lines()
                for raw in lines:
                    if not raw:
                        continue
                    line = json.loads(raw)
                    if "error" in line:
                        raise self._check(from_wire(None, line))
                    typed = read_line(line)
                    if isinstance(typed, DoneLine):
                        _rest(lines)
                        yield typed
                        return
                    yield typed
        except (_httpx().HTTPError, ValueError):
            pass
        try:  # a runner that died closed its sockets first: give its exit a moment to land
            if self.proc is not None:
                self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        # The daemon forgets a dead runner, so the next request loads the model afresh.
        raise RunnerError("llama runner process has terminated: the model crashed and is "
                          "loaded again on the next request" if not self.alive() else
                          "lost the connection to the runner process")

    def set_threads(self, n: int) -> None:
        """The runner's share of the cores (server.residency.threads); a runner that does not
        answer keeps what it had."""
        try:
            self._client().post("/threads", json=asdict(Threads(n)), timeout=CONTROL_DEADLINE)
        except (_httpx().HTTPError, RunnerError):
            pass

    def clear_cache(self) -> None:
        """Drop the runner's prompt cache from RAM: the memory is wanted for a model."""
        try:
            self._client().post("/cache/clear", json={}, timeout=CONTROL_DEADLINE)
        except (_httpx().HTTPError, RunnerError):
            pass

    def cancel(self, job_id: str) -> None:
        try:
            self._call("/cancel", asdict(Cancel(job_id)), CONTROL_DEADLINE)
        except (RunnerError, ValueError):
            pass

    def embed(self, job: EmbedJob) -> Embeddings:
        return Embeddings.from_json(self._call("/embed", job.to_json(), timeout=None))

    def rerank(self, job: RerankJob) -> Ranked:
        return Ranked.from_json(self._call("/rerank", job.to_json(), timeout=None))

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return [int(t) for t in self.tokens(Tokenize(text, add_special))]

    def tokens(self, command: Tokenize) -> list[Any]:
        """/tokenize as llama-server answers it: ids, or {"id", "piece"} with_pieces."""
        return list(self._call("/tokenize", asdict(command))["tokens"])

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._call("/detokenize", {"tokens": list(tokens)})["content"])

    def count(self, job: CompletionJob) -> int:
        """The tokens `job`'s prompt is, as /completion would evaluate them from cold."""
        return Counted(**self._call("/count", job.to_json())).prompt_tokens

    def health(self, timeout: float = 5.0) -> Health:
        """What the runner says of itself; RunnerError when it does not answer in time,
        EngineFailed (and dead from now on) when its engine failed."""
        try:
            resp = self._client().get("/health", timeout=timeout)
            data = resp.json()
        except (_httpx().HTTPError, ValueError) as exc:
            raise RunnerError(f"runner process is unreachable: {exc}") from None
        if resp.status_code >= 400:
            raise self._check(from_wire(resp.status_code, data))
        return Health.from_json(data)
