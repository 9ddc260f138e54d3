"""Dialect-neutral requests and the events a generation yields.

Messages and tools are the records of server.chat.messages, whichever API they came in; the
options are the request's JSON object, checked against the model in `prepare`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from corral.runner.fim import Infill
from corral.server.chat.messages import Message, Tool
from corral.server.chat.reply import Piece


class ChoiceMode(str, enum.Enum):
    AUTO = "auto"  # the model decides
    NONE = "none"  # no calls: the tools are left out of the prompt and the parser
    REQUIRED = "required"  # one call of any tool, forced by a grammar
    NAMED = "named"  # one call of the named tool, forced by a grammar


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str = ""

    @property
    def forced(self) -> bool:
        return self.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)


@dataclass(kw_only=True)
class TaskBase:
    """What every generation request carries, whichever API it came from."""

    model: str
    # The request's JSON object, checked in `prepare` once its model is found: an unknown
    # model is a 404 before a bad option is a 400, as in Ollama.
    options: Mapping[str, Any] = field(default_factory=dict)
    keep_alive: float | None = None
    think: bool | str | None = None
    # A model that cannot think drops `think` instead of refusing it: Anthropic's route,
    # where Claude Code asks every model to think (Ollama relaxes it there too).
    think_optional: bool = False
    format: Any = None  # None, "json" or a JSON schema (dict)
    grammar: str | None = None  # raw GBNF (Corral extension)
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    n: int = 1  # sequences sharing this prompt, each its own choice
    truncate: bool = True
    shift: bool = True


@dataclass(kw_only=True)
class ChatTask(TaskBase):
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


@dataclass(kw_only=True)
class CompletionTask(TaskBase):
    prompt: str
    suffix: str = ""
    raw: bool = False
    system: str | None = None
    template: str | None = None
    context: list[int] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    infill: Infill | None = None  # llama-server's /infill: a FIM prompt in place of `prompt`


Task = Union[ChatTask, CompletionTask]


@dataclass(frozen=True)
class Finished:
    """The end of one choice: why it stopped and what it cost."""

    index: int = 0
    done_reason: str = "stop"  # "stop", "length" or "cancel"
    called: bool = False  # the choice made at least one tool call
    prompt_tokens: int = 0  # the whole prompt
    cached_tokens: int = 0  # of which reused from the KV cache, not evaluated
    eval_count: int = 0
    prompt_eval_duration: int = 0  # nanoseconds, as the runner measured them
    eval_duration: int = 0
    load_duration: float = 0.0  # seconds spent getting the model ready
    total_duration: float = 0.0  # seconds, from the request's start
    context: tuple[int, ...] = ()  # prompt and reply tokens (native /api/generate)
    draft_count: int = 0  # tokens drafted by speculative decoding and verified
    draft_accepted_count: int = 0  # of which accepted

    @property
    def prompt_eval_count(self) -> int:
        return self.prompt_tokens - self.cached_tokens


Event = Union[Piece, Finished]  # pieces carry their choice in Piece.index
