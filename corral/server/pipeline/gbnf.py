"""GBNF text checked before llama.cpp parses it.

llama.cpp's grammar parser is recursive descent: parentheses nested twenty thousand
deep overflow its stack and take the runner, and every stream on it, down. So
every grammar a request brings or makes (a raw `grammar`, a `format` schema's, a
`tool_choice`'s) is scanned here first, outside strings, character classes and
comments: nesting depth, rule count and repetition bounds each have a limit, and
over one is a 400 that names it. The limits are far above what real grammars use
(llama.cpp's JSON grammar nests 4 deep; a schema converted from a 64-deep JSON body
stays well under 256).
"""

from __future__ import annotations

import re

from corral.errors import BadRequest

MAX_DEPTH = 256  # parentheses inside parentheses
MAX_RULES = 4096  # `name ::= ...` definitions
MAX_REPEAT = 10_000  # m and n in x{m} / x{m,n}

_BOUNDS = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_gbnf(text: str) -> None:
    depth, rules, i, n = 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            i = _past(text, i, "\n")
            continue
        if c in "\"[":
            i = _past_quoted(text, i, '"' if c == '"' else "]")
            continue
        if c == "(":
            depth += 1
            if depth > MAX_DEPTH:
                raise BadRequest(f"grammar nests parentheses more than {MAX_DEPTH} deep")
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "{":
            i = _check_bounds(text, i)
            continue
        elif text.startswith("::=", i):
            rules += 1
            if rules > MAX_RULES:
                raise BadRequest(f"grammar has more than {MAX_RULES} rules")
        i += 1


def _past(text: str, i: int, end: str) -> int:
    found = text.find(end, i + 1)
    return len(text) if found < 0 else found + 1


def _past_quoted(text: str, i: int, close: str) -> int:
    """Past a string literal or a character class, escapes included."""
    i += 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _check_bounds(text: str, i: int) -> int:
    match = _BOUNDS.match(text, i)
    if match is None:
        return i + 1  # not a repetition: llama.cpp's parser reports it
    for bound in match.groups():
        if bound and int(bound) > MAX_REPEAT:
            raise BadRequest(f"grammar repeats something {bound} times, over the limit of "
                             f"{MAX_REPEAT}")
    return match.end()


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
           "maxProperties", "minContains", "maxContains")


def check_schema(schema: object, where: str = "schema") -> None:
    """A JSON schema's counts bounded before llama.cpp's converter expands them: it
    writes `minLength: N` out as N copies of a rule, so a 10^9 would build gigabytes in
    the daemon before any grammar limit could be checked."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in _COUNTS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and value > MAX_REPEAT:
                    raise BadRequest(f"{where}: {key} {value} is over the limit of "
                                     f"{MAX_REPEAT}")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
