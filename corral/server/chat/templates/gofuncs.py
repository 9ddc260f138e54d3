"""Values and functions of Ollama's Go-template subset: truthiness, printing, builtins."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from corral.errors import BadRequest


class TemplateError(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(f"template error: {message}")


NO_VALUE = "<no value>"


def truthy(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) > 0
    return True


def go_json(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    # Go's encoder escapes HTML characters; templates were written against that output.
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _slice(value: Any, *idx: Any) -> Any:
    if len(idx) > 2:
        raise TemplateError("slice takes at most 2 indices")
    start = int(idx[0]) if idx else 0
    end = int(idx[1]) if len(idx) > 1 else len(value)
    if not 0 <= start <= end <= len(value):
        raise TemplateError("slice index out of range")
    return value[start:end]


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        try:
            value = value[key]
        except (IndexError, KeyError, TypeError):
            raise TemplateError(f"index {key!r} out of range") from None
    return value


def _compare(op: Callable[[Any, Any], bool]) -> Callable[..., bool]:
    def fn(a: Any, b: Any) -> bool:
        try:
            return op(a, b)
        except TypeError:
            raise TemplateError("incompatible types for comparison") from None
    return fn


def _and(*args: Any) -> Any:
    for a in args:
        if not truthy(a):
            return a
    return args[-1]


def _or(*args: Any) -> Any:
    for a in args:
        if truthy(a):
            return a
    return args[-1]


def _printf(fmt: str, *args: Any) -> str:
    conv = re.sub(r"%v", "%s", fmt)
    try:
        return conv % tuple(_show(a) if isinstance(a, (bool, type(None))) else a for a in args)
    except (TypeError, ValueError):
        raise TemplateError("bad printf") from None


FUNCS: dict[str, Callable[..., Any]] = {
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": _compare(lambda a, b: a != b),
    "lt": _compare(lambda a, b: a < b),
    "le": _compare(lambda a, b: a <= b),
    "gt": _compare(lambda a, b: a > b),
    "ge": _compare(lambda a, b: a >= b),
    "and": _and,
    "or": _or,
    "not": lambda a: not truthy(a),
    "len": lambda a: len(a),
    "slice": _slice,
    "index": _index,
    "json": go_json,
    "print": lambda *a: "".join(_show(x) for x in a),
    "printf": _printf,
}


def _show(value: Any) -> str:
    if value is None:
        return NO_VALUE
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (dict, list)):
        return go_json(value)
    return str(value)
