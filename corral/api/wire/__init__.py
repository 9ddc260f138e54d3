"""Wire types: one typed request record per API, validated once, at the edge.

pydantic v2 checks each body against its record (strict types: `"yes"` is no
boolean, `3` no list; ranges as each API documents them). Fields a record does
not name are ignored, as the real APIs ignore them, so clients that send more
than Corral reads keep working. Anything else is a `BadRequest` naming the field;
the route answers it in its own API's error shape.

Response records sit beside the requests as TypedDicts (a native final line, an
OpenAI completion and its usage, an Anthropic message, a Responses response): the
server's renderers build them, so mypy checks their shape and nothing needs
validating at run time.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from corral.errors import BadRequest


class Wire(BaseModel):
    """A request record: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


T = TypeVar("T", bound=Wire)


def describe(exc: ValidationError) -> str:
    """The first problem, as `field.path: what is wrong` (pydantic's words)."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"] if not _is_union_tag(part))
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"invalid request: {where}: {message}" if where else f"invalid request: {message}"


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union branch it tried: a type ("str", "list[...]",
    # "function-after[...]") or a record's class; the APIs' own field names are lowercase.
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in (
        "str", "int", "float", "bool", "dict", "list", "none"))


def parse(record: type[T], body: dict[str, Any]) -> T:
    """`body` as `record`, or a 400 that names the first field that is wrong."""
    try:
        return record.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(describe(exc)) from None
