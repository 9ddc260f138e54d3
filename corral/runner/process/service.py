"""The runner's service: wire requests in (runner.wire), engine jobs out (runner.jobs).
Every handler thread of the runner process (runner.process.main) shares one."""

from __future__ import annotations

import base64
import binascii
import math
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import llama_cpp as L

from corral.errors import BadRequest, CorralError
from corral.runner.engine.engine import Engine
from corral.runner.fim import FIM_REUSE, NULL, FimTokens, Infill, infill_tokens
from corral.runner.jobs import Embed, Failed, ImageSpan, Job, SamplingParams
from corral.runner.llama import native
from corral.runner.rankwire import Ranked, RerankJob
from corral.runner.llama.rerank import is_reranker, prompt_tokens, rerank_template
from corral.runner.wire import (CompletionJob, EmbedJob, Embeddings, LoadReport, TokenPiece,
                               Tokenize)

if TYPE_CHECKING:
    from corral.runner.llama.vision import Vision


@dataclass(frozen=True)
class Preparing:
    """A job whose prompt is still being made (its media encoded): cancellable already."""

    id: str
    cancelled: threading.Event

    def cancel(self) -> None:
        self.cancelled.set()


class RunnerService:
    """Turns wire requests into engine jobs; shared by all handler threads."""

    def __init__(self, engine: Engine, report: LoadReport,
                 vision: "Vision | None" = None) -> None:
        self.engine = engine
        self.vision = vision  # when a projector is loaded
        self.report = report
        self.jobs: dict[str, Job | Embed | Preparing] = {}  # by id, for /cancel
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.streams = 0  # completions being answered, under `ended`
        self.ended = threading.Condition()

    def prompt_tokens(self, wire: CompletionJob, limit: int = 0,
                      cancelled: threading.Event | None = None
                      ) -> tuple[list[int], list["ImageSpan"]]:
        """The prompt's tokens and its images' spans. The daemon rendered the text; each
        image sits at a media marker in it, in the order of `images`. Media over `limit`
        tokens are refused before they are encoded; `cancelled` stops their encoding."""
        images = _decode(list(wire.images))
        if images and self.vision is None:
            raise BadRequest("this model does not support images")
        context = list(wire.context)
        spans: list[ImageSpan] = []
        if wire.infill is not None:
            return self.infill_tokens(wire.infill), spans
        if images:
            assert self.vision is not None
            ids, spans = self.vision.prepare(wire.prompt, images, wire.add_bos and not context,
                                             max(limit - len(context), 1) if limit else 0,
                                             cancelled)
            spans = [span.shifted(len(context)) for span in spans]
        else:
            ids = self.engine.tokenize(wire.prompt, add_special=wire.add_bos and not context)
        tokens = context + ids
        if not tokens:
            raise BadRequest("empty prompt")
        return tokens, spans

    def infill_tokens(self, infill: Infill) -> list[int]:
        """llama-server's /infill prompt, from the vocabulary's own FIM tokens, in a
        sequence of this runner's per-slot context (llama-server's slot_n_ctx)."""
        vocab = self.engine.llama.vocab
        ids = {role: int(getattr(L, f"llama_vocab_fim_{role}")(vocab))
               for role in ("pre", "suf", "mid", "rep", "sep")}
        fim = FimTokens(**ids, bos=int(L.llama_vocab_bos(vocab)) if self.engine.llama.add_bos
                        else NULL)
        return infill_tokens(infill, fim, lambda text, special: native.tokenize(
            vocab, text, False, special), self.engine.llama.num_ctx)

    def count(self, wire: CompletionJob) -> int:
        """How many tokens /completion would evaluate for `wire` from a cold cache: the
        very tokens `job` would submit, counted instead."""
        return len(self.prompt_tokens(wire)[0])

    def tokenize(self, command: Tokenize) -> list[int] | list[TokenPiece]:
        """llama-server's /tokenize: llama_tokenize with its flags as sent (BOS only with
        add_special, as the vocabulary asks), each piece with control tokens' text."""
        vocab = self.engine.llama.vocab
        tokens = native.tokenize(vocab, command.content, command.add_special,
                                 command.parse_special)
        if not command.with_pieces:
            return tokens
        return [TokenPiece.of(t, native.token_bytes(vocab, t, True)) for t in tokens]

    def detokenize(self, tokens: list[int]) -> str:
        """llama-server's /detokenize: every token's text, control tokens' included, the
        bytes joined before they are decoded (a character may span tokens)."""
        n_vocab = self.engine.llama.n_vocab
        for token in tokens:
            if not 0 <= token < n_vocab:
                raise BadRequest(f"token {token} is not in the vocabulary (0 to {n_vocab - 1})")
        data = b"".join(native.token_bytes(self.engine.llama.vocab, t, True) for t in tokens)
        return data.decode("utf-8", "replace")

    def job(self, wire: CompletionJob) -> Job:
        # Cancellable from the start: a client that leaves while its media are encoded
        # stops that encode (the vision thread is every media request's).
        cancelled = threading.Event()
        if wire.id:
            with self.lock:
                self.jobs[wire.id] = Preparing(wire.id, cancelled)
        try:
            job = self._job(wire, cancelled)
        except BaseException:
            with self.lock:
                self.jobs.pop(wire.id, None)
            raise
        if job.id:
            with self.lock:
                self.jobs[job.id] = job
        return job

    def _job(self, wire: CompletionJob, cancelled: threading.Event) -> Job:
        """The engine's job for `wire`, its media prepared, submitted."""
        options = wire.options
        tokens, spans = self.prompt_tokens(wire, self.engine.llama.num_ctx, cancelled)
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
            reuse_chunk=FIM_REUSE if wire.infill is not None else 0,
            return_context=wire.return_context,
            cancelled=cancelled,
        )
        self.engine.submit(job)
        return job

    def opened(self) -> None:
        with self.ended:
            self.streams += 1

    def closed(self) -> None:
        with self.ended:
            self.streams -= 1
            self.ended.notify_all()

    def drain(self, timeout: float) -> None:
        """Wait until no completion is being answered, `timeout` seconds at most."""
        with self.ended:
            self.ended.wait_for(lambda: self.streams == 0, timeout=timeout)

    def forget(self, job: Job | Embed) -> None:
        with self.lock:
            self.jobs.pop(job.id, None)

    def fail_streams(self, error: CorralError) -> None:
        """End every completion held with `error` now, from outside the engine thread (a
        stalled one never will): each stream sends its error line at once, before the
        process exits and before the daemon, told by /health, stops it."""
        with self.lock:
            held = [job for job in self.jobs.values() if isinstance(job, Job)]
        for job in held:
            job.events.put(Failed(error))
        if self.vision is not None:  # and those whose media are still being prepared
            self.vision.fail(error)

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
        vectors = self._pooled(Embed(tokens, job.truncate, id=job.id))
        if job.dimensions > 0:
            vectors = [v[:job.dimensions] for v in vectors]
        if job.normalize:
            vectors = [_normalize(v) for v in vectors]
        return Embeddings(vectors, total)


    def rerank(self, job: RerankJob) -> Ranked:
        """Each document's score against the query, as llama-server's /rerank computes it:
        the documents are sequences of the engine's embedding batches (runner.llama.embedding)."""
        engine = self.engine
        if not is_reranker(engine.llama.model):
            raise BadRequest("this model is not a reranker (its GGUF has no rank pooling)")
        template = rerank_template(engine.llama.model)
        prompts = [prompt_tokens(engine.llama.vocab, template, job.query, doc)
                   for doc in job.documents]
        for i, tokens in enumerate(prompts):
            if len(tokens) > engine.llama.num_ctx:
                raise BadRequest(f"document {i} is too long: its prompt is {len(tokens)} "
                                 f"tokens, over the context of {engine.llama.num_ctx} (num_ctx)")
        total = sum(len(t) for t in prompts)
        if job.max_tokens and total > job.max_tokens:
            raise BadRequest(f"too many tokens: the documents' prompts hold {total}, over the "
                             f"limit of {job.max_tokens} (CORRAL_MAX_EMBED_TOKENS)")
        outputs = self._pooled(Embed(prompts, truncate=False, id=job.id))
        return Ranked([out[0] for out in outputs], sum(len(t) for t in prompts))

    def _pooled(self, command: Embed) -> list[list[float]]:
        """The engine's pooled outputs for `command`, cancellable by its id meanwhile."""
        if command.id:
            with self.lock:
                self.jobs[command.id] = command
        try:
            return self.engine.run_embed(command)
        finally:
            self.forget(command)


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
