"""The daemon: store, scheduler and HTTP server wired together.

`Daemon(settings)` is what `corral serve` runs and what the in-process tests
start on port 0. Runner processes come from `runner_factory`, a constructor
seam the scheduler tests use for fakes.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
from typing import IO, TYPE_CHECKING, Any, Callable

from corral.config import Settings, state_dir
from corral.private import private_dir
from corral.process import limit_malloc_arenas, pin_mmap_threshold, trim_malloc
from corral.errors import CorralError
from corral.registry.store import Store
from corral.runner.client import RunnerProcess
from corral.runner.loadconfig import LoadConfig
from corral.server.chat.models import Models
from corral.server.pipeline.services import Services
from corral.server.residency.scheduler import Runner, Scheduler

if TYPE_CHECKING:
    from corral.registry.download import DownloadOptions
    from corral.registry.pull import Puller
    from corral.registry.push import Pusher, PushOptions
    from corral.server.http import Route

log = logging.getLogger("corral")
HOUSEKEEPING_SECONDS = 10.0


def routes(services: Services, puller: Puller, pusher: Pusher
           ) -> list[tuple[str, str, Route]]:
    """(method, path, route): a path may end in Starlette's `{name:path}` for a prefix."""
    from corral.server import lifecycle, manage, page
    from corral.server.dialects import (anthropic, infill, native, openai, openai_misc,
                                        render, rerank, responses, tokens, transcriptions)

    blobs = manage.blobs(services)
    return [
        ("GET", "/", manage.root(services)),
        ("GET", "/api/hello", manage.root(services)),  # Claude Code's warm-up (HEAD) of its base
        ("GET", "/api/version", manage.version(services)),
        ("POST", "/api/generate", native.generate(services)),
        ("POST", "/api/chat", native.chat(services)),
        ("POST", "/api/embed", native.embed(services)),
        ("POST", "/api/embeddings", native.embeddings(services)),
        ("POST", "/api/tokenize", tokens.api_tokenize(services)),
        ("POST", "/api/detokenize", tokens.api_detokenize(services)),
        ("POST", "/tokenize", tokens.llama_tokenize(services)),  # llama-server's
        ("POST", "/detokenize", tokens.llama_detokenize(services)),
        *[("POST", path, rerank.jina_rerank(services)) for path in rerank.JINA_PATHS],
        ("POST", "/v2/rerank", rerank.cohere_rerank(services)),  # Cohere's v2
        ("POST", "/infill", infill.infill(services)),  # llama-server's code completion
        ("GET", "/api/tags", manage.tags(services)),
        ("POST", "/api/show", manage.show(services)),
        ("POST", "/api/create", lifecycle.create(services)),
        ("POST", "/api/copy", manage.copy(services)),
        ("DELETE", "/api/delete", manage.delete(services)),
        ("GET", "/api/ps", manage.ps(services)),
        ("POST", "/api/pull", lifecycle.pull(services, puller)),
        ("POST", "/api/push", lifecycle.push(services, pusher)),
        ("HEAD", "/api/blobs/{digest:path}", blobs),
        ("POST", "/api/blobs/{digest:path}", blobs),
        ("GET", "/metrics", manage.metrics(services)),
        ("POST", "/v1/chat/completions", openai.chat_completions(services)),
        ("POST", "/v1/completions", openai.completions(services)),
        ("POST", "/v1/embeddings", openai_misc.embeddings(services)),
        ("GET", "/v1/models", openai_misc.models(services)),
        ("GET", "/v1/models/{name:path}", openai_misc.model(services)),
        ("POST", "/v1/messages", anthropic.messages(services)),
        ("POST", "/v1/messages/count_tokens", anthropic.count_tokens(services)),
        ("POST", "/v1/responses", responses.responses(services)),
        ("POST", "/v1/responses/input_tokens", responses.input_tokens(services)),
        ("POST", "/v1/audio/transcriptions", transcriptions.transcriptions(services)),
        ("POST", "/corral/render", render.render(services)),  # Corral's: the rendered prompt
        ("GET", "/ui", page.page()),  # the page for people
        ("GET", page.PREFIX + "{file:path}", page.page()),
    ]


class Daemon:
    def __init__(self, settings: Settings,
                 runner_factory: Callable[[LoadConfig], Runner] | None = None,
                 runner_log: IO[bytes] | None = None,
                 download_options: DownloadOptions | None = None,
                 preload: str | None = None, push_options: PushOptions | None = None,
                 store: Store | None = None) -> None:
        self.settings = settings
        if settings.cache_disk:  # runners write prompts under it (kvcache/): private first
            private_dir(state_dir())
        # `store`: one the caller made over settings.models, with a quota (capacity).
        self.store = store or Store(settings.models)
        factory = runner_factory or (lambda config: RunnerProcess(config, runner_log))
        self.scheduler = Scheduler(settings, factory,
                                   inspect=lambda r: self.store.gguf_info(r.model_digest))
        self.models = Models(self.store)
        if preload:
            self.preload(preload)  # the runner starts while the HTTP stack loads
        # Imported here, after the preload started: uvicorn, Starlette, httpx and
        # prometheus-client take a few tenths of a second to import, which a cold
        # `corral run` would otherwise wait for before its model even starts loading.
        from corral.registry.download import Downloader, DownloadOptions
        from corral.registry.pull import Puller
        from corral.registry.push import Pusher, PushOptions
        from corral.server.asgi import HttpServer, build_app
        from corral.server.manage import runner_gauges
        from corral.server.metrics import Metrics

        metrics = Metrics(lambda: runner_gauges(self.scheduler))
        self.services = Services(self.store, self.models, self.scheduler, metrics)

        self.downloader = Downloader(self.store, download_options or DownloadOptions())
        self.puller = Puller(self.store, self.downloader)
        self.pusher = Pusher(self.store, push_options or PushOptions())
        table = routes(self.services, self.puller, self.pusher)
        self.http = HttpServer(build_app(table, settings), settings.host.host,
                               settings.host.port, settings)
        self._stop_housekeeping = threading.Event()
        threading.Thread(target=self._housekeeping, args=(self._stop_housekeeping,),
                         name="housekeeping", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.http.address

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> "Daemon":
        """Serve on a background thread (tests); `serve_forever` is the blocking form."""
        self.http.start()
        return self

    def preload(self, model: str) -> None:
        """Start loading `model` now, on a helper thread: a CLI that starts the daemon for
        `corral run` gets its runner spawned while it is still waiting for the port."""
        def load() -> None:
            try:
                view = self.models.view(model)
                self.scheduler.load(view.record, view.options(None), None)
            except CorralError as exc:
                log.info("preloading %s: %s", model, exc.message)
        threading.Thread(target=load, name="preload", daemon=True).start()

    def _housekeeping(self, stop: threading.Event) -> None:
        # Request bodies, responses and short-lived worker threads leave free pages
        # scattered through the heap; without a trim the resident size creeps up for
        # a quarter of an hour under load before it levels off. The collection comes
        # first: a stream abandoned mid-way leaves its runner connection's objects
        # (buffers included) in reference cycles, which a long-lived process collects
        # only every few minutes, pinning the pages the trim would hand back.
        while not stop.wait(HOUSEKEEPING_SECONDS):
            gc.collect()
            trim_malloc()

    def prune(self) -> None:
        if not self.settings.noprune:
            removed = self.store.prune()
            if removed:
                log.info("pruned %d unused blobs", len(removed))

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM, then stop gracefully."""
        host, port = self.address
        if not self.settings.host.is_loopback():
            log.warning("listening on %s:%d, which is reachable from other machines", host, port)
        log.info("Listening on %s:%d", host, port)

        def on_signal(signum: int, frame: Any) -> None:
            log.info("received signal %d, shutting down", signum)
            self.http.server.should_exit = True

        # uvicorn serves on its own thread: its own signal handling would re-raise the
        # signal after a graceful stop, and `corral serve` must exit 0 on SIGTERM.
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            self.http.start()
            self.http.wait()
        finally:
            self.close()
            log.info("stopped")

    def close(self) -> None:
        self._stop_housekeeping.set()
        self.scheduler.stop()
        self.http.sock.close()

    def shutdown(self) -> None:
        self.http.stop()
        self.close()


def run(settings: Settings, preload: str | None = None) -> None:
    """What `corral serve` does: log to stderr, prune, serve until SIGINT or SIGTERM."""
    limit_malloc_arenas()
    pin_mmap_threshold()
    configure_logging(settings.debug)
    try:
        daemon = Daemon(settings, runner_log=sys.stderr.buffer, preload=preload)
    except OSError as exc:
        raise CorralError(f"could not listen on {settings.host}: {exc.strerror or exc}") from None
    daemon.prune()
    # Everything imported so far lives as long as the process: frozen, the full
    # collections in housekeeping walk only what requests allocate (about 10,000
    # objects under the soak's load), not also the ~40,000 from startup, whose walk
    # alone holds the GIL for 12 ms.
    gc.freeze()
    daemon.serve_forever()


def configure_logging(debug: int, stream: IO[str] = sys.stderr) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=stream,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per runner call would drown the daemon's own log.
    logging.getLogger("httpx").setLevel(logging.DEBUG if debug > 1 else logging.WARNING)
