"""What routes share: model lookup, capabilities, options, grammars, templates and
embeddings. The one generation path is server.pipeline.run, which calls down into this
module and never the other way; holding a model belongs to the scheduler."""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from corral.config import parse_duration
from corral.errors import BadRequest, CorralError, ModelNotFound
from corral.options import coerce_options
from corral.registry.models import ModelRecord, Records
from corral.registry.names import parse_name
from corral.registry.projector import projector_problem
from corral.registry.store import Store
from corral.server.images import check_images
from corral.server.metrics import Metrics
from corral.server.reply import template_calls_tools, template_thinks
from corral.server.scheduler import Scheduler

if TYPE_CHECKING:
    from corral.server.prompt import PromptBuilder

log = logging.getLogger("corral.inference")


def require_model(name: Any) -> str:
    """The model a request names; every route that needs one asks here."""
    if name is not None and not isinstance(name, str):
        raise BadRequest("model must be a string")
    if not name:
        raise BadRequest("model is required")
    return name


def keep_alive_of(value: Any) -> float | None:
    """Ollama's keep_alive: a duration ("5m", "1h30m"), seconds, or negative for ever."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise BadRequest(f"invalid keep_alive duration: {value!r}") from None


def grammar_for(fmt: Any, max_bytes: int) -> str | None:
    """Ollama's `format`: "json", a JSON schema object, or nothing."""
    if fmt in (None, "", "null"):
        return None
    from corral.runner.capi import pure_module

    grammars = pure_module("llama_grammar")  # not `import llama_cpp`: see pure_module
    if fmt == "json":
        return str(grammars.JSON_GBNF)
    if isinstance(fmt, dict):
        from corral.server.pipeline.gbnf import check_schema

        check_schema(fmt, "the JSON schema in format")
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
    if template_calls_tools(template):
        caps.append("tools")
    if ".Suffix" in template:
        caps.append("insert")
    if vision:
        caps.append("vision")
    if template_thinks(template):
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

    def load_only(self, record: ModelRecord, options: dict[str, Any],
                  keep_alive: float | None) -> float:
        """Schedule the model without generating; returns the load time in seconds."""
        start = time.perf_counter()
        with self.scheduler.hold(record, options, keep_alive):
            pass
        return time.perf_counter() - start

    def embed(self, record: ModelRecord, inputs: list[str], options: Any,
              keep_alive: float | None, truncate: bool = True, normalize: bool = True,
              dimensions: int = 0,
              on_disconnect: Callable[[Callable[[], None]], Any] | None = None,
              ) -> tuple[dict[str, Any], float]:
        """The runner's embeddings and the seconds spent getting the model ready."""
        limit = self.settings.max_embed_inputs
        if len(inputs) > limit:
            raise BadRequest(f"too many inputs: {len(inputs)} is over the limit of {limit}"
                             " (CORRAL_MAX_EMBED_INPUTS)")
        start = time.perf_counter()
        merged = self.options(record, options)
        job_id = uuid.uuid4().hex
        with self.scheduler.hold(record, merged, keep_alive) as entry:
            load = time.perf_counter() - start
            runner = entry.runner
            assert runner is not None
            # A client that leaves stops the batch at the runner's next slice.
            watcher = on_disconnect(lambda: runner.cancel(job_id)) if on_disconnect else None
            try:
                result = runner.embed(inputs, truncate, normalize, dimensions,
                                      self.settings.max_embed_tokens, job_id)
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

    def capabilities(self, record: ModelRecord, template: str) -> list[str]:
        return capabilities(self.store, record, template)

    def grammar(self, raw: str | None, fmt: Any) -> str | None:
        """A raw GBNF `grammar` (Corral extension) or the grammar of a `format`; not both.
        A raw grammar parses when its job starts (a 400 if it does not)."""
        limit = self.settings.max_grammar_bytes
        if raw in (None, ""):
            return grammar_for(fmt, limit)
        if fmt not in (None, "", "null"):
            raise BadRequest("give either a format or a grammar, not both")
        if len(str(raw).encode()) > limit:
            raise BadRequest(f"grammar is over the limit of {limit} bytes "
                             "(CORRAL_MAX_GRAMMAR_BYTES)")
        return str(raw)

    def prompt_builder(self, record: ModelRecord, bos: str, eos: str,
                       override: str | None = None) -> PromptBuilder:
        """The model's template (a TEMPLATE layer, else the GGUF's Jinja, else a plain
        fallback), compiled once per template and BOS/EOS pair."""
        if override:
            return _builder(override, None, bos, eos)
        jinja = None
        if not record.template:
            try:
                jinja = self.store.gguf_info(record.model_digest).chat_template or None
            except CorralError:
                jinja = None
        return _builder(record.template or None, jinja, bos, eos)

    def jinja_builder(self, source: str, bos: str, eos: str) -> PromptBuilder:
        """A builder for a Jinja chat template given with a request (/corral/render)."""
        try:
            return _builder(None, source, bos, eos)
        except CorralError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that does not compile
            raise BadRequest(f"invalid chat template: {exc}") from None


@functools.lru_cache(maxsize=32)
def _builder(go: str | None, jinja: str | None, bos: str, eos: str) -> PromptBuilder:
    from corral.server.prompt import PromptBuilder  # jinja2 waits for the first chat

    return PromptBuilder(go, jinja, bos, eos)
