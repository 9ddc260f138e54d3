"""The runner process: one model, one engine, served on a loopback port.

The daemon starts one per loaded model, so a crash inside llama.cpp takes down
only this process. It prints one JSON line on stdout when it is ready (its
port and load report), then serves:

    GET  /health                  engine status
    POST /completion              a CompletionJob (runner.wire) -> NDJSON: {"content"} lines,
                                  then a final {"done": true, ...}
    POST /embed                   {"embeddings": [[...]], "prompt_eval_count": n}
    POST /tokenize, /detokenize   the model's own tokenizer, as llama-server's: the daemon
                                  renders text and needs neither; tests and tools that
                                  count tokens against a runner do
    POST /cancel                  {"id"}
    POST /threads                 {"n"}: the daemon's share of the cores, from now on
    POST /cache/clear             drop the prompt cache's RAM (memory is wanted elsewhere)
    POST /shutdown
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable

from corral.errors import BadRequest, CorralError, NotFound, Shape, format_error
from corral.runner.engine import Engine
from corral.runner.jobs import Done, Embed, Job, SamplingParams, Token
from corral.runner.loadconfig import LoadConfig
from corral.runner.loading import LoadedModel, Pending, load
from corral.runner.wire import (Cancel, CompletionJob, Detokenize, EmbedJob, Embeddings, Health,
                               LoadReport, Threads, TokenLine, Tokenize, read_command)

if TYPE_CHECKING:
    from corral.runner.vision import ImageSpan, Vision

log = logging.getLogger("corral.runner")
MAX_BODY = 32 << 20
# From the daemon's death to our exit: the disk tier's write included, which the next
# daemon does not wait for (exit_with_parent).
ORPHAN_GRACE = 3.0


class RunnerService:
    """Turns wire requests into engine jobs; shared by all handler threads."""

    def __init__(self, engine: Engine, report: LoadReport,
                 vision: "Vision | None" = None) -> None:
        self.engine = engine
        self.vision = vision  # when a projector is loaded
        self.report = report
        self.jobs: dict[str, Job | Embed] = {}  # by id, for /cancel
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def prompt_tokens(self, wire: CompletionJob) -> tuple[list[int], list["ImageSpan"]]:
        """The prompt's tokens and its images' spans. The daemon rendered the text; each
        image sits at a media marker in it, in the order of `images`."""
        images = _decode(list(wire.images))
        if images and self.vision is None:
            raise BadRequest("this model does not support images")
        context = list(wire.context)
        spans: list[ImageSpan] = []
        if images:
            assert self.vision is not None
            ids, spans = self.vision.prepare(wire.prompt, images, wire.add_bos and not context)
            spans = [span.shifted(len(context)) for span in spans]
        else:
            ids = self.engine.tokenize(wire.prompt, add_special=wire.add_bos and not context)
        tokens = context + ids
        if not tokens:
            raise BadRequest("empty prompt")
        return tokens, spans

    def job(self, wire: CompletionJob) -> Job:
        options = wire.options
        tokens, spans = self.prompt_tokens(wire)
        job = Job(
            prompt=tokens,
            params=SamplingParams.from_options(options),
            num_predict=-1 if options.num_predict is None else options.num_predict,
            stop=list(options.stop or ()),
            num_keep=4 if options.num_keep is None else options.num_keep,
            grammar=wire.grammar,
            truncate=wire.truncate,
            shift=wire.shift,
            ignore_eos=bool(options.ignore_eos),
            logprobs=wire.logprobs,
            special=wire.special,
            id=wire.id,
            images=tuple(spans),
        )
        self.engine.submit(job)
        if job.id:
            with self.lock:
                self.jobs[job.id] = job
        return job

    def forget(self, job: Job | Embed) -> None:
        with self.lock:
            self.jobs.pop(job.id, None)

    def cancel(self, job_id: str) -> bool:
        with self.lock:
            job = self.jobs.get(job_id)
        if job is not None:
            job.cancel()
        return job is not None

    def embed(self, job: EmbedJob) -> Embeddings:
        tokens = [self.engine.tokenize(text) for text in job.input]
        total = sum(len(t) for t in tokens)
        if job.max_tokens and total > job.max_tokens:
            raise BadRequest(f"too many tokens: the inputs hold {total}, over the limit of "
                             f"{job.max_tokens} (CORRAL_MAX_EMBED_TOKENS)")
        command = Embed(tokens, job.truncate, id=job.id)
        if command.id:
            with self.lock:
                self.jobs[command.id] = command
        try:
            vectors = self.engine.run_embed(command)
        finally:
            self.forget(command)
        if job.dimensions > 0:
            vectors = [v[:job.dimensions] for v in vectors]
        if job.normalize:
            vectors = [_normalize(v) for v in vectors]
        return Embeddings(vectors, total)


def _decode(images: Any) -> list[bytes]:
    if not isinstance(images, list):
        raise BadRequest("images must be a list of base64 strings")
    try:
        return [base64.b64decode(i, validate=True) for i in images]
    except (binascii.Error, TypeError, ValueError):
        raise BadRequest("an image is not valid base64") from None


def _normalize(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection; a stream ends at EOF
    service: RunnerService

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
        if length > MAX_BODY:
            raise BadRequest("request body too large")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise BadRequest("invalid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be an object")
        return body

    def do_GET(self) -> None:
        if self.path == "/health":
            vision = self.service.vision
            health = Health.from_json({**self.service.engine.status(),
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
            elif route == "/tokenize":
                job = read_command(Tokenize, body)
                self._send(200, {"tokens": self.service.engine.tokenize(job.content,
                                                                        job.add_special)})
            elif route == "/detokenize":
                tokens = list(read_command(Detokenize, body).tokens)
                self._send(200, {"content": self.service.engine.detokenize(tokens)})
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
        job = self.service.job(CompletionJob.from_json(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        try:
            while True:
                event = job.events.get()
                if isinstance(event, Token):
                    line = TokenLine(event.text, tuple(event.logprobs or ())).to_json()
                elif isinstance(event, Done):
                    line = event.stats.to_json()
                else:
                    line = format_error(event.error, Shape.RUNNER)[1]
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
                if not isinstance(event, Token):
                    break
        except OSError:
            job.cancel()  # the daemon hung up: free the slot
        finally:
            self.service.forget(job)


def _shutdown(service: RunnerService) -> None:
    if service.server is not None:
        service.server.shutdown()


def build(config: LoadConfig, loaded: LoadedModel | None = None) -> RunnerService:
    loaded = loaded or load(config)
    est = loaded.estimate
    engine = Engine(config.model, loaded.engine_config, llama=loaded.llama,
                    load_seconds=loaded.seconds)
    import llama_cpp as L

    from corral.runner import native

    bos = native.token_bytes(engine.vocab, L.llama_vocab_bos(engine.vocab), True).decode(
        "utf-8", "replace")
    eos = native.token_bytes(engine.vocab, L.llama_vocab_eos(engine.vocab), True).decode(
        "utf-8", "replace")
    report = LoadReport(
        weights=est.weights, kv=est.kv, compute=est.compute,
        gpu_layers=est.gpu_layers, layers=est.layers,
        size=est.total, size_vram=est.gpu_bytes - loaded.rpc_bytes,
        size_rpc=loaded.rpc_bytes, rpc_servers=tuple(config.rpc_servers),
        num_ctx=engine.num_ctx, n_ctx=engine.n_ctx, slots=config.n_slots,
        # Elastic KV holds start_slots' worth while idle: `size` is what the cap holds.
        start_slots=len(engine.slots), kv_per_slot=est.kv // max(config.n_slots, 1),
        n_threads=engine.n_threads, load_seconds=engine.load_seconds,
        bos=bos, eos=eos, can_shift=engine.can_shift, n_ctx_train=engine.n_ctx_train,
        vision=loaded.vision is not None)
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


def main(argv: list[str] | None = None, pending: Pending | None = None) -> int:
    pending = pending or Pending(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if pending.args.verbose else logging.WARNING,
                        stream=sys.stderr, format="runner %(levelname)s %(message)s")
    try:
        loaded = pending.result()
        service = build(loaded.config, loaded)
    except CorralError as exc:
        print(json.dumps(format_error(exc, Shape.RUNNER)[1]), flush=True)
        return 1
    # A listen backlog of five (the standard library's) overflows when sixteen slots'
    # streams and their cancels connect at once; a dropped handshake can surface in the
    # daemon as a lost connection.
    server_class = type("RunnerHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": 256})
    server = server_class(("127.0.0.1", 0), type("H", (Handler,), {"service": service}))
    server.daemon_threads = True
    service.server = server
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(
        target=server.shutdown, daemon=True).start())
    service.engine.start()
    threading.Thread(target=exit_with_parent, args=(os.getppid(), server.shutdown),
                     daemon=True).start()
    print(json.dumps({"port": server.server_address[1], "pid": os.getpid(),
                      "report": service.report.to_json()}), flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        service.engine.stop()
        if service.vision is not None:
            service.vision.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
