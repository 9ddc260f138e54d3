"""The runner wire, typed once: what the daemon sends a runner process for a completion.

    daemon --CompletionJob (JSON)--> runner /completion --{"content"} lines,
                                     then a {"done": true, ...} line or an error line

The daemon builds a CompletionJob from a request's plan (server.pipeline.run) and the
runner client sends it; the runner process reads it back with `from_json`, which
checks every field and coerces the options once, so nothing past it reads a dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from corral.errors import BadRequest
from corral.options import coerce_options


@dataclass(frozen=True)
class CompletionJob:
    prompt: str  # the text the daemon rendered; the runner tokenizes it
    add_bos: bool = True
    images: tuple[str, ...] = ()  # base64, in the order of the prompt's media markers
    context: tuple[int, ...] = ()  # tokens before the text (native /api/generate's context)
    grammar: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # coerced (corral.options)
    id: str = ""  # for /cancel
    truncate: bool = True
    shift: bool = True
    special: bool = False  # render control tokens as text
    logprobs: int = -1  # -1: none; else alternatives per token

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["images"], out["context"] = list(self.images), list(self.context)
        return out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "CompletionJob":
        """A job from the wire: a 400 names the first field that is not what it must be."""
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise BadRequest(f"unknown job fields: {', '.join(sorted(unknown))}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        images, context = body.get("images") or [], body.get("context") or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise BadRequest("images must be a list of base64 strings")
        if not isinstance(context, list) or not all(isinstance(t, int) for t in context):
            raise BadRequest("context must be a list of token ids")
        grammar = body.get("grammar")
        if grammar is not None and not isinstance(grammar, str):
            raise BadRequest("grammar must be a string")
        logprobs = body.get("logprobs", -1)
        return cls(prompt=prompt, add_bos=_flag(body, "add_bos", True), images=tuple(images),
                   context=tuple(context), grammar=grammar or None,
                   options=coerce_options(body.get("options")), id=str(body.get("id") or ""),
                   truncate=_flag(body, "truncate", True), shift=_flag(body, "shift", True),
                   special=_flag(body, "special", False),
                   logprobs=logprobs if isinstance(logprobs, int) else -1)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value
