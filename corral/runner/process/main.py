"""The runner process: one model, one engine, served on a loopback port.

The daemon starts one per loaded model, so a crash inside llama.cpp takes down
only this process. It prints one JSON line on stdout when it is ready (its
port and load report), then serves:

    GET  /health                  engine status
    POST /completion              a CompletionJob (runner.wire) -> NDJSON: {"content"} lines,
                                  then a final {"done": true, ...}
    POST /embed                   {"embeddings": [[...]], "prompt_eval_count": n}
    POST /rerank                  a RerankJob (runner.rankwire) -> {"scores", "prompt_eval_count"}
    POST /tokenize, /detokenize   the model's own tokenizer, as llama-server's: the daemon
                                  renders text and needs neither; tests and tools that
                                  count tokens against a runner do
    POST /count                   a CompletionJob -> {"prompt_tokens"}: what /completion would
                                  evaluate from cold (the daemon's token counts)
    POST /cancel                  {"id"}
    POST /threads                 {"n"}: the daemon's share of the cores, from now on
    POST /cache/clear             drop the prompt cache's RAM (memory is wanted elsewhere)
    POST /shutdown
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from corral.errors import BadRequest, CorralError, NotFound, RunnerError, Shape, format_error
from corral.runner.engine.plan import StepPlan
from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Failed, Job, JobEvent, Token
from corral.runner.loadconfig import LoadConfig
from corral.runner.process.loading import LoadedModel, Pending, load
from corral.runner.process.service import RunnerService
from corral.runner.rankwire import RerankJob
from corral.runner.wire import (Cancel, CompletionJob, Counted, Detokenize, EmbedJob, Health,
                               LoadReport, Threads, TokenLine, Tokenize, read_command)

log = logging.getLogger("corral.runner")
MAX_BODY = 32 << 20  # at least: twice the daemon's CORRAL_MAX_BODY (LoadConfig.max_body)
STREAM_DRAIN = 5.0  # seconds a failed runner waits for its streams' error lines to go out
# From the daemon's death to our exit: the disk tier's write included, which the next
# daemon does not wait for (exit_with_parent).
ORPHAN_GRACE = 3.0


class Handler(BaseHTTPRequestHandler):
    # Kept-alive connections: a new one for each request cost the daemon a connect and us
    # a thread started, about a millisecond before every first token. A stream is sent
    # chunked, so that its end is not the connection's.
    protocol_version = "HTTP/1.1"
    service: RunnerService
    max_body = MAX_BODY

    def setup(self) -> None:
        super().setup()
        # Token lines are small writes: without this, each waits on a delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.max_body:
            self.close_connection = True  # its body is left unread on the socket
            raise BadRequest("request body too large")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise BadRequest("invalid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be an object")
        return body

    def do_GET(self) -> None:
        failure = self.service.engine.failure
        if self.path == "/health" and failure is not None:  # the daemon forgets us at once
            self._send(*format_error(failure, Shape.RUNNER))
        elif self.path == "/health":
            vision = self.service.vision
            engine = self.service.engine
            health = Health.from_json({**engine.status(),
                                       "kv_bytes": engine.kv_held(self.service.report.kv),
                                       "images_encoded": vision.encoded if vision else 0})
            self._send(200, {"status": "ok", **health.to_json(),
                             "report": self.service.report.to_json()})
        else:
            self._send(*format_error(NotFound("not found"), Shape.RUNNER))

    def do_POST(self) -> None:
        try:
            body = self._body()
            route = self.path
            if route == "/completion":
                self._completion(body)
            elif route == "/embed":
                self._send(200, self.service.embed(EmbedJob.from_json(body)).to_json())
            elif route == "/rerank":
                self._send(200, self.service.rerank(RerankJob.from_json(body)).to_json())
            elif route == "/tokenize":
                tokens = self.service.tokenize(read_command(Tokenize, body))
                self._send(200, {"tokens": [t if isinstance(t, int) else asdict(t)
                                            for t in tokens]})
            elif route == "/detokenize":
                tokens = list(read_command(Detokenize, body).tokens)
                self._send(200, {"content": self.service.detokenize(tokens)})
            elif route == "/count":
                counted = Counted(self.service.count(CompletionJob.from_json(body)))
                self._send(200, asdict(counted))
            elif route == "/threads":
                n = read_command(Threads, body).n
                self.service.engine.set_threads(n)
                self._send(200, {"threads": n})
            elif route == "/cache/clear":
                self.service.engine.clear_cache()
                self._send(200, {"status": "cleared"})
            elif route == "/cancel":
                self._send(200, {"cancelled": self.service.cancel(read_command(Cancel,
                                                                               body).id)})
            elif route == "/shutdown":
                # Started before the reply: a daemon that gave up waiting for it (the
                # engine thread held the GIL) must not leave us running.
                threading.Thread(target=_shutdown, args=(self.service,), daemon=True).start()
                self._send(200, {"status": "shutting down"})
            else:
                raise NotFound("not found")
        except CorralError as exc:
            self._send(*format_error(exc, Shape.RUNNER))
        except (ValueError, TypeError) as exc:
            self._send(*format_error(BadRequest(str(exc)), Shape.RUNNER))

    def _completion(self, body: dict[str, Any]) -> None:
        wire = CompletionJob.from_json(body)
        self.service.opened()  # from here: a failing runner waits for this one's answer
        try:
            try:
                job = self.service.job(wire)
            except CorralError as exc:
                self._send(*format_error(exc, Shape.RUNNER))
                return
            self._stream(job)
        finally:
            self.service.closed()

    def _stream(self, job: Job) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            ended = False
            while not ended:
                # What is queued goes in one write: a stream that fell a step behind
                # catches up with one system call, not one a token. The last chunk
                # goes with the end line, which the daemon reads it with.
                lines = []
                for event in _ready_events(job, self.service.engine):
                    lines.append(json.dumps(_line(event)).encode() + b"\n")
                    ended = not isinstance(event, Token)
                data = b"".join(lines)
                self.wfile.write(b"%x\r\n%s\r\n%s" % (len(data), data,
                                                        b"0\r\n\r\n" if ended else b""))
                self.wfile.flush()
        except OSError:
            self.close_connection = True
            job.cancel()  # the daemon hung up: free the slot
        finally:
            self.service.forget(job)


# How often a stream waiting for its next token looks at the engine: an event that never
# comes (the engine thread gone without answering it) ends the stream, not the runner.
EVENT_POLL = 1.0


def _line(event: JobEvent) -> dict[str, Any]:
    if isinstance(event, Token):
        return TokenLine(event.text, tuple(event.logprobs or ())).to_json()
    if isinstance(event, Done):
        return event.stats.to_json()
    return format_error(event.error, Shape.RUNNER)[1]


def _ready_events(job: Job, engine: Engine) -> list[JobEvent]:
    """The job's next event, waited for, and every one queued behind it, up to its end."""
    events = [_next_event(job, engine)]
    while isinstance(events[-1], Token):
        try:
            events.append(job.events.get_nowait())
        except queue.Empty:
            break
    return events


def _next_event(job: Job, engine: Engine) -> JobEvent:
    while True:
        try:
            return job.events.get(timeout=EVENT_POLL)
        except queue.Empty:
            if engine.failure is not None or not engine.running():
                return Failed(engine.failure or RunnerError("the engine has stopped"))


def _shutdown(service: RunnerService) -> None:
    if service.server is not None:
        service.server.shutdown()


def build(config: LoadConfig, loaded: LoadedModel | None = None,
          step_hook: Callable[[StepPlan], None] | None = None) -> RunnerService:
    loaded = loaded or load(config)
    est = loaded.estimate
    engine = Engine(config.model, loaded.engine_config, llama=loaded.llama,
                    load_seconds=loaded.seconds, step_hook=step_hook, drafts=loaded.draft)
    import llama_cpp as L

    from corral.runner.llama import native

    llama = engine.llama
    bos = native.token_bytes(llama.vocab, L.llama_vocab_bos(llama.vocab), True).decode(
        "utf-8", "replace")
    eos = native.token_bytes(llama.vocab, L.llama_vocab_eos(llama.vocab), True).decode(
        "utf-8", "replace")
    # host memory beside the estimate's compute buffer: the cells' bookkeeping, and the
    # recurrent states kept for taking back drafts; the KV at the cap with the most the
    # slots' checkpoints hold; both of the last as measured at load in place of the
    # estimate's (checkpoints counted as they are read: Engine.kv_held)
    cells = llama.cells_bytes() + llama.snapshot_bytes()
    checkpoints = llama.checkpoint_bytes()
    kv = est.kv - est.snapshots
    report = LoadReport(
        weights=est.weights, kv=kv + checkpoints, compute=est.compute + cells,
        gpu_layers=est.gpu_layers, layers=est.layers,
        size=est.total - est.checkpoints - est.snapshots + cells + checkpoints,
        size_vram=est.gpu_bytes - loaded.rpc_bytes,
        size_rpc=loaded.rpc_bytes, rpc_servers=tuple(config.rpc_servers),
        num_ctx=llama.num_ctx, n_ctx=llama.n_ctx, slots=config.n_slots,
        # Elastic KV holds start_slots' worth while idle: `size` is what the cap holds.
        start_slots=len(engine.slots), kv_per_slot=kv // max(config.n_slots, 1),
        n_threads=llama.n_threads, load_seconds=engine.load_seconds,
        bos=bos, eos=eos, can_shift=llama.can_shift, n_ctx_train=llama.n_ctx_train,
        vision=loaded.vision is not None, draft=loaded.draft_bytes,
        draft_error=loaded.draft_error)
    return RunnerService(engine, report, loaded.vision)


def exit_with_parent(parent: int, shutdown: Callable[[], None], poll: float = 0.5,
                     grace: float = ORPHAN_GRACE,
                     end: Callable[[int], None] = os._exit) -> None:
    """A daemon that died without stopping us (SIGKILL, a crash, the OOM killer) must not
    leave us behind. Its death re-parents us (to init or a subreaper), which getppid shows.

    The usual stop follows, and it writes the disk tier (CORRAL_CACHE_DISK); but no daemon
    waits for that now, and the next one may be loading this model beside us, into the
    memory we hold, so the stop gets `grace` seconds and then the process ends where it
    is. Nothing is left half-written: each disk entry is written to a temporary name and
    renamed, and the next load removes a stray temporary file. Not PR_SET_PDEATHSIG: it
    fires when the daemon's thread that started us ends, not the daemon."""
    while os.getppid() == parent:
        time.sleep(poll)
    log.warning("the daemon is gone; shutting down")
    deadline = threading.Timer(grace, end, args=(1,))
    deadline.daemon = True
    deadline.start()
    shutdown()


def watch_steps(service: RunnerService, bound: float, every: float = 1.0) -> None:
    """Progress, not presence: an engine thread inside one step for longer than `bound`
    (CORRAL_STEP_TIMEOUT; the first step after the load, which pages the weights in, has
    a grace: StepWatch.bound), or inside a resize's copy, or the media thread inside one
    decode, tokenize or encode, is stalled in native code, and is declared so. Its streams end with the error first, then /health
    answers it, and the process exits as after a failure; the daemon replaces it as it
    does a crash."""
    engine, vision = service.engine, service.vision
    watches = [engine.watch] + ([vision.watch] if vision is not None else [])
    while not engine.failed.wait(min(every, bound / 4)):
        for watch in watches:
            limit = watch.bound(bound)  # first: the first step may end between the two
            seconds = watch.running_for()
            if seconds > limit:
                engine.stall(seconds, limit, first=service.fail_streams, what=watch.what)


def _exit_on_failure(service: RunnerService, server: ThreadingHTTPServer) -> None:
    """A failed engine ends the process, once the streams it held have sent their error
    lines (a few seconds at most): the daemon sees a crash and loads the model afresh."""
    service.engine.failed.wait()
    service.drain(STREAM_DRAIN)
    server.shutdown()


def main(argv: list[str] | None = None, pending: Pending | None = None,
         step_hook: Callable[[StepPlan], None] | None = None) -> int:
    pending = pending or Pending(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if pending.args.verbose else logging.WARNING,
                        stream=sys.stderr, format="runner %(levelname)s %(message)s")
    try:
        loaded = pending.result()
        service = build(loaded.config, loaded, step_hook)
    except CorralError as exc:
        print(json.dumps(format_error(exc, Shape.RUNNER)[1]), flush=True)
        return 1
    # A listen backlog of five (the standard library's) overflows when sixteen slots'
    # streams and their cancels connect at once; a dropped handshake can surface in the
    # daemon as a lost connection.
    server_class = type("RunnerHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": 256})
    server = server_class(("127.0.0.1", 0), type("H", (Handler,), {
        "service": service, "max_body": max(MAX_BODY, 2 * loaded.config.max_body)}))
    server.daemon_threads = True
    service.server = server
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(
        target=server.shutdown, daemon=True).start())
    service.engine.start()
    threading.Thread(target=exit_with_parent, args=(os.getppid(), server.shutdown),
                     daemon=True).start()
    threading.Thread(target=_exit_on_failure, args=(service, server), daemon=True).start()
    if loaded.config.step_timeout > 0:
        threading.Thread(target=watch_steps, args=(service, loaded.config.step_timeout),
                         daemon=True, name="step-watch").start()
    print(json.dumps({"port": server.server_address[1], "pid": os.getpid(),
                      "report": service.report.to_json()}), flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        service.engine.stop()
        if service.vision is not None:
            service.vision.close()
    vision = service.vision
    if service.engine.running() or (vision is not None and vision.alive()):
        # stalled inside native code: no clean exit can wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1 if service.engine.failure is not None else 0


if __name__ == "__main__":
    sys.exit(main())
