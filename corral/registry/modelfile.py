"""Modelfile parsing: line-oriented instructions, `#` comments, quoted multi-line values."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from corral.errors import InvalidOption, ModelfileError
from corral.options import IGNORED_OPTIONS, coerce_option

log = logging.getLogger("corral.modelfile")

INSTRUCTIONS = ("from", "license", "template", "system", "adapter", "draft", "renderer",
                "parser", "parameter", "message", "requires")
ROLES = ("system", "user", "assistant")
MAX_MODELFILE_BYTES = 1 << 20


@dataclass
class Modelfile:
    from_: str
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    licenses: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None
    adapters: list[str] = field(default_factory=list)
    projectors: list[str] = field(default_factory=list)  # FROM lines after the first
    draft: str | None = None  # DRAFT: a model name or a GGUF path (registry/draft.py)


def _split_commands(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, raw value), joining quoted values that span lines."""
    commands: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i].strip(), i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        if "\t" in head:
            head, _, more = head.partition("\t")
            rest = more + " " + rest
        value = rest.strip()
        for quote in ('"""', '"'):
            if value.startswith(quote):
                while not _closed(value, quote):
                    if i >= len(lines):
                        raise ModelfileError(f"(line {number}): unterminated {quote}")
                    value += "\n" + lines[i]
                    i += 1
                value = value.strip()[len(quote) : -len(quote)]
                break
        commands.append((number, head.lower(), value))
    return commands


def _closed(value: str, quote: str) -> bool:
    body = value.strip()
    return len(body) >= 2 * len(quote) and body.endswith(quote)


def parse_modelfile(text: str) -> Modelfile:
    if len(text.encode("utf-8", errors="replace")) > MAX_MODELFILE_BYTES:
        raise ModelfileError("Modelfile is too large")
    text = text.lstrip("\ufeff")
    pending: dict[str, Any] = {"parameters": {}, "licenses": [], "messages": None, "adapters": [],
                               "extra_from": []}
    scalar: dict[str, str | None] = {"from": None, "template": None, "system": None,
                                     "draft": None}
    for number, instruction, value in _split_commands(text):
        if instruction not in INSTRUCTIONS:
            names = ", ".join(f'"{n}"' for n in INSTRUCTIONS[:-1])
            raise ModelfileError(
                f"(line {number}): command must be one of {names}, or \"{INSTRUCTIONS[-1]}\""
            )
        if instruction == "from" and scalar["from"]:
            pending["extra_from"].append(value)  # a second FROM: a projector, as Ollama's
        elif instruction in scalar:
            scalar[instruction] = value
        elif instruction == "parameter":
            _add_parameter(pending["parameters"], value, number)
        elif instruction == "license":
            pending["licenses"].append(value)
        elif instruction == "message":
            role, _, content = value.partition(" ")
            if role.lower() not in ROLES:
                raise ModelfileError(
                    'message role must be one of "system", "user", or "assistant"')
            if pending["messages"] is None:
                pending["messages"] = []
            pending["messages"].append({"role": role.lower(), "content": content.strip()})
        elif instruction == "adapter":
            pending["adapters"].append(value)
        else:
            log.warning("ignoring Modelfile instruction %s", instruction.upper())
    if not scalar["from"]:
        raise ModelfileError("no FROM line")
    return Modelfile(
        from_=scalar["from"],
        parameters=pending["parameters"],
        template=scalar["template"],
        system=scalar["system"],
        licenses=pending["licenses"],
        messages=pending["messages"],
        adapters=pending["adapters"],
        projectors=pending["extra_from"],
        draft=scalar["draft"],
    )


def _add_parameter(params: dict[str, Any], value: str, number: int) -> None:
    name, _, raw = value.partition(" ")
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        raw = raw[1:-1]
    if not name or not name.replace("_", "").isalnum() or not name.isascii():
        raise ModelfileError(f"(line {number}): invalid parameter name {name!r}")
    if name in IGNORED_OPTIONS:
        log.warning("parameter %r is deprecated and ignored", name)
        return
    try:
        if name == "stop":
            params.setdefault("stop", []).extend(coerce_option("stop", [raw]))
        else:
            params[name] = coerce_option(name, raw)
    except InvalidOption as exc:
        raise ModelfileError(f"(line {number}): {exc.message}") from None


def format_modelfile(froms: str | list[str], parameters: dict[str, Any], template: str | None,
                     system: str | None, licenses: list[str],
                     messages: list[dict[str, str]] | None, adapters: tuple[str, ...] = (),
                     draft: str | None = None) -> str:
    """Render a Modelfile that recreates a model (used by `show --modelfile`): one FROM
    for the weights, one more for a vision projector, and its draft model's file."""
    froms = [froms] if isinstance(froms, str) else froms
    out = [f"FROM {f}" for f in froms] + [f"ADAPTER {path}" for path in adapters]
    out += [f"DRAFT {draft}"] if draft else []
    if template:
        out.append(f'TEMPLATE """{template}"""')
    if system:
        out.append(f'SYSTEM """{system}"""')
    for key, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            shown = f'"{item}"' if isinstance(item, str) else str(item).lower() \
                if isinstance(item, bool) else str(item)
            out.append(f"PARAMETER {key} {shown}")
    for message in messages or []:
        out.append(f"MESSAGE {message['role']} {message['content']}")
    for text in licenses:
        out.append(f'LICENSE """{text}"""')
    return "\n".join(out) + "\n"
