"""What the native and OpenAI routes share: model lookup, options, and one generation.

A generation counts itself in with the scheduler, holds its model for the
duration, cancels its runner job when the client goes away, and always
releases the model, whatever happens.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from corral.config import parse_duration
from corral.errors import BadRequest, CorralError, ModelNotFound, RunnerError
from corral.options import coerce_options
from registry.models import ModelRecord, Records
from registry.names import parse_name
from registry.projector import projector_problem
from registry.store import Store
from server.harmony import uses_harmony
from server.images import check_images
from server.metrics import Metrics
from server.scheduler import Loaded, Scheduler

log = logging.getLogger("corral.inference")


@dataclass
class Outcome:
    """Collected while a generation streams; read by the route for its final object."""

    stats: dict[str, Any] = field(default_factory=dict)
    load_duration: float = 0.0
    prompt_tail: str = ""  # the end of the rendered prompt, known before the first piece
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # of the piece just yielded
    started: float = field(default_factory=time.perf_counter)


def require_model(name: Any) -> str:
    """The model a request names; every route that needs one asks here."""
    if name is not None and not isinstance(name, str):
        raise BadRequest("model must be a string")
    if not name:
        raise BadRequest("model is required")
    return name


def keep_alive_of(body: dict[str, Any]) -> float | None:
    if body.get("keep_alive") is None:
        return None
    try:
        return parse_duration(body["keep_alive"])
    except ValueError:
        raise BadRequest(f"invalid keep_alive duration: {body['keep_alive']!r}") from None


def grammar_for(fmt: Any, max_bytes: int) -> str | None:
    """Ollama's `format`: "json", a JSON schema object, or nothing."""
    if fmt in (None, "", "null"):
        return None
    from runner.capi import pure_module

    grammars = pure_module("llama_grammar")  # not `import llama_cpp`: see pure_module
    if fmt == "json":
        return str(grammars.JSON_GBNF)
    if isinstance(fmt, dict):
        if len(json.dumps(fmt)) > max_bytes:
            raise BadRequest(f"the JSON schema in format is over the limit of {max_bytes} bytes"
                             " (CORRAL_MAX_GRAMMAR_BYTES)")
        try:
            return str(grammars.json_schema_to_gbnf(json.dumps(fmt)))
        except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
            raise BadRequest(f"invalid JSON schema in format: {exc}") from None
    raise BadRequest("invalid format")


def has_vision(store: Store, record: ModelRecord) -> bool:
    """A projector is present and one the runner can load beside these weights (a GGUF
    that merely describes a vision tower, without a projector, cannot see)."""
    if record.projector_digest is None:
        return False
    try:
        return projector_problem(store.gguf_info(record.projector_digest),
                                 store.gguf_info(record.model_digest)) is None
    except CorralError:
        return False


def capabilities(store: Store, record: ModelRecord, template: str) -> list[str]:
    caps = []
    try:
        info = store.gguf_info(record.model_digest)
        embedding = f"{info.architecture}.pooling_type" in info.metadata
    except CorralError:
        embedding = False
    vision = has_vision(store, record)
    caps.append("embedding" if embedding else "completion")
    if ".Tools" in template or "tools" in template or "tool_call" in template:
        caps.append("tools")
    if ".Suffix" in template:
        caps.append("insert")
    if vision:
        caps.append("vision")
    if "<think>" in template or ".Think" in template or uses_harmony(template):
        caps.append("thinking")
    return caps


class Inference:
    def __init__(self, store: Store, scheduler: Scheduler, metrics: Metrics) -> None:
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.settings = scheduler.settings
        self.records = Records(store)

    def record(self, name: Any, not_found: str = "model '{}' not found") -> ModelRecord:
        stored = self.store.resolve(parse_name(require_model(name)))
        if stored is None:
            raise ModelNotFound(not_found.format(name))
        return self.records.get(stored)

    def options(self, record: ModelRecord, requested: Any) -> dict[str, Any]:
        """Built-in defaults < the model's PARAMETERs < the request's options."""
        merged = coerce_options(record.parameters)
        merged.update(coerce_options(requested))
        return merged

    def template_text(self, record: ModelRecord) -> str:
        if record.template:
            return record.template
        try:
            return self.store.gguf_info(record.model_digest).chat_template or ""
        except CorralError:
            return ""

    @contextmanager
    def hold(self, record: ModelRecord, options: dict[str, Any],
             keep_alive: float | None, max_slots: int = 0) -> Iterator[Loaded]:
        """Count the request in, hold a ready model, and always release it."""
        ticket = self.scheduler.admit(record)
        entry = self.scheduler.acquire(ticket, record, options, keep_alive, max_slots)
        try:
            yield entry
        finally:
            self.scheduler.release(entry)

    def load_only(self, record: ModelRecord, options: dict[str, Any],
                  keep_alive: float | None, max_slots: int = 0) -> float:
        """Schedule the model without generating; returns the load time in seconds.
        `max_slots` caps what auto sizing gives it, if this call loads it."""
        start = time.perf_counter()
        with self.hold(record, options, keep_alive, max_slots):
            pass
        return time.perf_counter() - start

    def embed(self, record: ModelRecord, body: dict[str, Any], inputs: list[str],
              normalize: bool, dimensions: int = 0,
              on_disconnect: Callable[[Callable[[], None]], Any] | None = None,
              ) -> tuple[dict[str, Any], float]:
        """The runner's embeddings and the seconds spent getting the model ready."""
        limit = self.settings.max_embed_inputs
        if len(inputs) > limit:
            raise BadRequest(f"too many inputs: {len(inputs)} is over the limit of {limit}"
                             " (CORRAL_MAX_EMBED_INPUTS)")
        start = time.perf_counter()
        options = self.options(record, body.get("options"))
        job_id = uuid.uuid4().hex
        with self.hold(record, options, keep_alive_of(body)) as entry:
            load = time.perf_counter() - start
            runner = entry.runner
            assert runner is not None
            # A client that leaves stops the batch at the runner's next slice.
            watcher = on_disconnect(lambda: runner.cancel(job_id)) if on_disconnect else None
            try:
                result = runner.embed(inputs, bool(body.get("truncate", True)), normalize,
                                      dimensions, self.settings.max_embed_tokens, job_id)
            finally:
                if watcher is not None:
                    watcher.set()
        return result, load

    def images(self, record: ModelRecord, images: Any, seen: int = 0) -> list[str]:
        """A request's images, checked; a model without a working projector gets
        Ollama's 400 before anything is decoded."""
        if not has_vision(self.store, record):
            raise BadRequest(f"{record.name.full()} does not support vision")
        return check_images(images, self.settings, seen)

    def chat_messages(self, record: ModelRecord, messages: Any) -> list[dict[str, Any]]:
        """Checked request messages after the model's own MESSAGES and SYSTEM."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a list of objects")
        out = []
        seen = 0  # images so far, for the per-request limit
        for m in messages:
            role = str(m.get("role", "")).lower()
            if role not in ("system", "user", "assistant", "tool"):
                raise BadRequest(f"invalid message role {role!r}")
            content = m.get("content") or ""
            if not isinstance(content, str):
                raise BadRequest("message content must be a string")
            message = {**m, "role": role, "content": content}
            if m.get("images"):
                message["images"] = self.images(record, m["images"], seen)
                seen += len(message["images"])
            out.append(message)
        full = list(record.messages) + out
        if record.system and not (full and full[0].get("role") == "system"):
            full.insert(0, {"role": "system", "content": record.system})
        return full

    def generate(self, record: ModelRecord, runner_body: dict[str, Any], options: dict[str, Any],
                 keep_alive: float | None, outcome: Outcome,
                 on_disconnect: Callable[[Callable[[], None]], Any] | None = None,
                 ) -> Iterator[str]:
        """Yield text pieces; fills `outcome` with the runner's final statistics."""
        model = record.name.display()
        gone = [False]
        job_id = uuid.uuid4().hex
        if uses_harmony(self.template_text(record)):  # its markers are control tokens
            runner_body = {**runner_body, "special": True}
        held: list[Loaded] = []

        def cancel() -> None:
            gone[0] = True
            if held and held[0].runner is not None:
                held[0].runner.cancel(job_id)

        watcher = on_disconnect(cancel) if on_disconnect is not None else None
        try:
            t0 = time.perf_counter()
            with self.hold(record, options, keep_alive) as entry:
                held.append(entry)
                outcome.load_duration = time.perf_counter() - t0
                if gone[0]:
                    self.metrics.request(model, "cancelled")
                    return
                yield from self._stream(entry, model, {**runner_body, "options": options,
                                                       "id": job_id}, outcome)
                stats = outcome.stats
                self.metrics.tokens(model, stats.get("prompt_eval_count", 0),
                                    stats.get("eval_count", 0), stats.get("eval_duration", 0))
                self.metrics.request(model, "cancelled" if gone[0] else "ok")
        finally:
            if watcher is not None:
                watcher.set()

    def _stream(self, entry: Loaded, model: str, body: dict[str, Any],
                outcome: Outcome) -> Iterator[str]:
        runner = entry.runner
        assert runner is not None
        first = True
        try:
            for line in runner.completion(body):
                if "prompt_tail" in line:
                    outcome.prompt_tail = str(line["prompt_tail"])
                elif "content" in line:
                    if first:
                        first = False
                        self.metrics.ttft(model, time.perf_counter() - outcome.started)
                    outcome.logprobs = list(line.get("logprobs") or [])
                    yield line["content"]
                if line.get("done"):
                    outcome.stats = line
        except RunnerError:
            self.scheduler.runner_failed(entry)
            self.metrics.request(model, "error")
            raise
