"""What every chat-style route shares: the `think` value, the raw-grammar extension,
and a generation's text turned into thinking, content and tool calls as it streams."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

from corral.errors import BadRequest
from server.inference import Outcome
from server.reply import Format, Piece, ReplyParser, reply_format

THINK_LEVELS = ("low", "medium", "high")
MAX_TOP_LOGPROBS = 20


def think_value(raw: Any) -> bool | str | None:
    """Ollama's `think`: true, false, or a level; anything else is a 400."""
    if raw is None or isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in THINK_LEVELS:
        return raw.lower()
    if raw in ("true", "false"):
        return raw == "true"
    raise BadRequest(f"invalid think value: {raw!r} (must be true, false, \"low\", "
                     "\"medium\" or \"high\")")


def check_think(think: bool | str | None, caps: list[str], model: str) -> None:
    if think and "thinking" not in caps:
        raise BadRequest(f'"{model}" does not support thinking')


def raw_grammar(body: dict[str, Any], max_bytes: int, fmt: Any = None) -> str | None:
    """A GBNF grammar given as `grammar` (llama-server's field; a Corral extension).

    It parses when the job starts (a 400 if it does not); `fmt` is the request's
    structured-output format, which may not be given with it."""
    grammar = body.get("grammar")
    options = body.get("options")
    if grammar in (None, "") and isinstance(options, dict):
        grammar = options.get("grammar")  # clients that send only known fields pass options
    if grammar in (None, ""):
        return None
    if not isinstance(grammar, str):
        raise BadRequest("grammar must be a string")
    if fmt not in (None, "", "null"):
        raise BadRequest("give either a format or a grammar, not both")
    if len(grammar.encode()) > max_bytes:
        raise BadRequest(f"grammar is over the limit of {max_bytes} bytes "
                         "(CORRAL_MAX_GRAMMAR_BYTES)")
    return grammar


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)}


def pieces_of(text: Iterator[str], outcome: Outcome, template: str, think: bool | str | None,
              tools: list[dict[str, Any]]) -> Iterator[Piece]:
    """The generation's pieces, parsed once the prompt's end is known (first piece)."""
    fmt: Format = reply_format(template, bool(think), bool(tools))
    parser: ReplyParser | None = None
    held: list[dict[str, Any]] = []  # log-probabilities wait for the piece their text makes
    for chunk in text:
        if parser is None:
            opened = fmt.think is not None and \
                outcome.prompt_tail.rstrip().endswith(fmt.think[0])
            parser = ReplyParser(fmt, tool_names(tools), thinking_open=opened)
        held += outcome.logprobs
        yield from _with_logprobs(parser.feed(chunk), held)
    if parser is not None:
        yield from _with_logprobs(parser.finish(), held)


def _with_logprobs(pieces: list[Piece], held: list[dict[str, Any]]) -> Iterator[Piece]:
    for piece in pieces:
        if held:
            piece = replace(piece, logprobs=tuple(held))
            held.clear()
        yield piece


def logprobs_request(logprobs: Any, top: Any) -> int | None:
    """`logprobs` (a bool) and `top_logprobs` (0-20) as the runner's count, or None."""
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    if not logprobs and not top:
        return None
    return int(top or 0)
