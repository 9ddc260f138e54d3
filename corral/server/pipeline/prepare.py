"""`prepare(view, request, limits)`: every check a request needs before its model
loads, as a pure function of the request and its model's view. It reads no store and
holds no model, so a bad request is a 400 before anything waits, and the same request
against the same view always gives the same plan."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from corral.config import Settings
from corral.errors import BadRequest
from corral.options import Options
from corral.server.chat.messages import Message, Tool
from corral.server.chat.harmony import uses_harmony
from corral.server.chat.images import check_images
from corral.server.chat.models import ModelView
from corral.server.pipeline.grammar import request_grammar
from corral.server.pipeline.request import ChatTask, ChoiceMode, Task
from corral.server.chat.reply import Format, reply_format


@dataclass(frozen=True)
class Plan:
    """What `prepare` decided; the same for every choice of the request."""

    request: Task
    view: ModelView
    options: Options
    fmt: Format
    tools: list[Tool]  # as the template and parser see them (none for "none")
    grammar: str | None  # a raw or `format` grammar; a tool_choice one is made per prompt
    messages: list[Message] = field(default_factory=list)  # chat, checked
    images: list[str] = field(default_factory=list)  # completion, checked
    special: bool = False  # control tokens as text (harmony's markers)
    think: bool | str | None = None  # the request's, or on for a thinking model that left it out
    think_dropped: bool = False  # asked of a model that cannot think, on a route that allows it

    @property
    def tool_names(self) -> set[str]:
        return {t.name for t in self.tools}


def prepare(view: ModelView, request: Task, limits: Settings) -> Plan:
    """The plan of `request` against `view`, or a 400 naming what is wrong."""
    caps = view.capabilities
    if view.rerank:
        raise BadRequest(not_generative(view))
    dropped = bool(request.think) and "thinking" not in caps
    if dropped and not request.think_optional:
        raise BadRequest(f'"{request.model}" does not support thinking')
    # No `think` sent: a thinking model thinks, as Ollama decides (Hugging Face's templates
    # mostly default to it too, but Corral follows Ollama where the two differ).
    think = None if dropped else \
        True if request.think is None and "thinking" in caps else request.think
    tools = _tools(view, request)
    grammar = request_grammar(request.grammar, request.format, limits.max_grammar_bytes)
    raw = not isinstance(request, ChatTask) and request.raw  # text as written, unsplit
    fmt = Format() if raw else reply_format(view.template, bool(think), bool(tools))
    messages: list[Message] = []
    images: list[str] = []
    if isinstance(request, ChatTask):
        messages = chat_messages(view, request.messages, limits)
    elif request.images:
        images = checked_images(view, request.images, limits)
    return Plan(request, view, view.options(request.options), fmt, tools, grammar,
                messages, images, special=uses_harmony(view.template), think=think,
                think_dropped=dropped)


def not_generative(view: ModelView) -> str:
    return (f"{view.name} is a reranker: it scores documents against a query "
            "(POST /v1/rerank) and does not generate text")


def _tools(view: ModelView, request: Task) -> list[Tool]:
    """The tools the prompt lists; and a completion's suffix, which needs `insert`."""
    if not isinstance(request, ChatTask):
        if request.suffix and "insert" not in view.capabilities:
            raise BadRequest(f"{view.name} does not support insert")
        return []
    if request.tools and "tools" not in view.capabilities:
        raise BadRequest(f"{view.name} does not support tools")
    choice = request.tool_choice
    if choice.forced and not request.tools:
        raise BadRequest(f"tool_choice {choice.mode.value!r} needs tools")
    if choice.forced and (request.grammar or request.format not in (None, "")):
        raise BadRequest("tool_choice forces a call: it cannot be given with a format "
                         "or a grammar")
    return [] if choice.mode is ChoiceMode.NONE else list(request.tools)


def checked_images(view: ModelView, images: list[str], limits: Settings,
                   seen: int = 0) -> list[str]:
    """A request's media (pictures and audio clips), checked; an item the model cannot
    take (no projector, or none with that encoder) gets Ollama's 400, naming what it
    does not support, before the item is decoded any further than its header."""
    return check_images(images, limits, seen, view.vision, view.audio, view.name)


def chat_messages(view: ModelView, messages: list[Message],
                  limits: Settings) -> list[Message]:
    """Checked request messages after the model's own MESSAGES and SYSTEM."""
    out = []
    seen = 0  # images so far, for the per-request limit
    for m in messages:
        role = m.role.lower()
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"invalid message role {role!r}")
        images = tuple(checked_images(view, list(m.images), limits, seen)) if m.images else ()
        seen += len(images)
        out.append(replace(m, role=role, images=images))
    record = view.record
    full = list(view.messages) + out
    if record.system and not (full and full[0].role == "system"):
        full.insert(0, Message("system", record.system))
    return full
