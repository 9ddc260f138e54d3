"""A model as requests see it, described once: `Models.view(name)` resolves a name to a
frozen `ModelView` (its record, the template its prompts are rendered with, its
capabilities, its PARAMETER defaults and its prompt builders). Everything a request
needs to know about its model before a load is read here, from the store, once per
manifest; preparing the request (pipeline/prepare.py) is then a pure function of the
request and the view."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from corral.errors import BadRequest, CorralError, ModelNotFound
from corral.options import Options
from corral.registry.fim import missing
from corral.registry.models import ModelRecord, Records
from corral.registry.names import Name, parse_name
from corral.registry.projector import projector_media, projector_problem
from corral.registry.store import Store
from corral.server.chat.messages import Message
from corral.server.chat.reply import template_calls_tools, template_thinks

if TYPE_CHECKING:
    from corral.server.chat.prompt import PromptBuilder

VIEWS_CACHED = 64
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a reranker's GGUF


def require_model(name: Any) -> str:
    """The model a request names; every route that needs one asks here."""
    if name is not None and not isinstance(name, str):
        raise BadRequest("model must be a string")
    if not name:
        raise BadRequest("model is required")
    return name


def capabilities(template: str, embedding: bool, vision: bool,
                 rerank: bool = False, fim: frozenset[str] = frozenset(),
                 audio: bool = False) -> tuple[str, ...]:
    """Ollama's capability list: what the weights are for, and what the template can do.
    A reranker (rank pooling) only scores documents, whatever its chat template says.
    `insert` is a template that renders `.Suffix`, or, beyond Ollama, the vocabulary's
    fill-in-the-middle tokens (registry/fim.py), which a suffix is then written with."""
    if rerank:
        return ("rerank",)
    caps = ["embedding" if embedding else "completion"]
    if template_calls_tools(template):
        caps.append("tools")
    if ".Suffix" in template or (not embedding and not missing(fim)):
        caps.append("insert")
    if vision:
        caps.append("vision")
    if audio:
        caps.append("audio")
    if template_thinks(template):
        caps.append("thinking")
    return tuple(caps)


@dataclass(frozen=True)
class ModelView:
    """Everything about a model that a request is checked and rendered against. Shared
    between requests: nothing may modify it (its record included)."""

    record: ModelRecord
    template: str  # a TEMPLATE layer, else the GGUF's chat template, else ""
    jinja: str | None  # the GGUF's Jinja chat template, used when no TEMPLATE layer is
    embedding: bool  # the weights pool into embeddings
    vision: bool  # a projector with a vision encoder the runner can load beside these weights
    capabilities: tuple[str, ...]
    defaults: Options  # the model's PARAMETERs, coerced
    rerank: bool = False  # the weights pool to a relevance score (rank pooling)
    fim: frozenset[str] = frozenset()  # the vocabulary's FIM roles (registry/fim.py)
    audio: bool = False  # that projector has an audio encoder

    @property
    def infill(self) -> str:
        """Why /infill cannot run on this model (llama-server's words), or ""."""
        return missing(self.fim)

    @property
    def name(self) -> str:
        return self.record.name.full()

    @functools.cached_property
    def messages(self) -> tuple[Message, ...]:
        """The model's MESSAGE layers as records, made once for every request it serves."""
        return tuple(Message.of(m) for m in self.record.messages)

    def options(self, requested: Any) -> Options:
        """The model's PARAMETERs < the request's options (its JSON object, checked here,
        after the model is found: an unknown model is a 404 before a bad option is a 400,
        as in Ollama)."""
        return Options.parse(requested).over(self.defaults)

    def with_template(self, template: str | None) -> ModelView:
        """The view a request that brings its own chat template sees (/corral/render)."""
        if not template:
            return self
        return replace(self, template=template,
                       capabilities=capabilities(template, self.embedding, self.vision,
                                                 self.rerank, self.fim, self.audio))

    def builder(self, bos: str, eos: str, go: str | None = None) -> PromptBuilder:
        """The prompt builder for the runner's BOS and EOS text: the TEMPLATE layer, else
        the GGUF's Jinja, else a plain fallback; `go` overrides it (a request's
        `template`). Compiled once per template and BOS/EOS pair."""
        if go:
            return _builder(go, None, bos, eos)
        return _builder(self.record.template or None, self.jinja, bos, eos)


def jinja_builder(source: str, bos: str, eos: str) -> PromptBuilder:
    """A builder for a Jinja chat template given with a request (/corral/render)."""
    try:
        return _builder(None, source, bos, eos)
    except CorralError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template that does not compile
        raise BadRequest(f"invalid chat template: {exc}") from None


@functools.lru_cache(maxsize=32)
def _builder(go: str | None, jinja: str | None, bos: str, eos: str) -> PromptBuilder:
    from corral.server.chat.prompt import PromptBuilder  # jinja2 waits for the first chat

    return PromptBuilder(go, jinja, bos, eos)


class Models:
    """Names resolved to views. A view is a function of the manifest's record (which
    Records builds again only when the manifest's bytes change), so it is kept for as
    long as that record is the one the store gives."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.records = Records(store)
        self._views: OrderedDict[str, ModelView] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, name: Any, not_found: str = "model '{}' not found") -> ModelView:
        stored = self.store.resolve(parse_name(require_model(name)))
        if stored is None:
            raise ModelNotFound(not_found.format(name))
        return self.view_of(self.records.get(stored))

    def view_of(self, record: ModelRecord) -> ModelView:
        key = record.name.display()
        with self._lock:
            hit = self._views.get(key)
            if hit is not None and hit.record is record:
                self._views.move_to_end(key)
                return hit
        view = self._describe(record)
        with self._lock:
            self._views[key] = view
            while len(self._views) > VIEWS_CACHED:
                self._views.popitem(last=False)
        return view

    def view_by_name(self, name: Name) -> ModelView:
        """The view of a name the store already holds (as `Store.resolve` spells it)."""
        return self.view_of(self.records.get(name))

    def _describe(self, record: ModelRecord) -> ModelView:
        try:
            info = self.store.gguf_info(record.model_digest)
            pooling = info.metadata.get(f"{info.architecture}.pooling_type")
            jinja, embedding, fim = info.chat_template or None, pooling is not None, info.fim
        except CorralError:
            jinja, embedding, pooling, fim = None, False, None, frozenset()
        rerank = pooling == RANK_POOLING
        template = record.template or jinja or ""
        vision, audio = self._media(record)
        return ModelView(record, template, None if record.template else jinja, embedding,
                         vision, capabilities(template, embedding, vision, rerank, fim, audio),
                         Options.parse(record.parameters), rerank, fim, audio)

    def _media(self, record: ModelRecord) -> tuple[bool, bool]:
        """(vision, audio): what the model's projector lets it take in. A GGUF that merely
        describes a vision tower, without a projector, cannot see."""
        if record.projector_digest is None:
            return False, False
        try:
            projector = self.store.gguf_info(record.projector_digest)
            if projector_problem(projector, self.store.gguf_info(record.model_digest)):
                return False, False
        except CorralError:
            return False, False
        return projector_media(projector)
