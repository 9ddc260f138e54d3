"""`tool_choice` enforced: a GBNF grammar that lets the model write one call, in its
template's own call format, of the tool it must call (or of any of them).

Each tool's `parameters` schema becomes the rule for its arguments through
llama.cpp's own JSON-schema converter, one converter for all tools so that their
rules share names without clashing. The reply parser then reads the call as it
reads any other: the grammar only removes the model's freedom not to call.
"""

from __future__ import annotations

import json

from corral.errors import BadRequest
from corral.runner.llama.capi import pure_module
from corral.server.chat.messages import EMPTY_SCHEMA, Tool
from corral.server.pipeline.gbnf import check_schema
from corral.server.chat.reply import MISTRAL_TAG, TOOL_TAGS, Format


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does


def _call_rule(fmt: Format, name: str, args: str) -> str:
    """One call of `name` whose arguments match the rule `args`."""
    quoted = json.dumps(name)
    if fmt.tools == "tags":  # Qwen, Hermes
        before, after = f'{TOOL_TAGS[0]}\n{{"name": {quoted}, "arguments": ', f"}}\n{TOOL_TAGS[1]}"
    elif fmt.tools == "mistral":
        before, after = f'{MISTRAL_TAG}[{{"name": {quoted}, "arguments": ', "}]"
    elif fmt.tools == "harmony":  # gpt-oss: a commentary message addressed to the tool
        before = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        after = "<|call|>"
    else:  # Llama 3.x: a bare JSON object opens the reply, arguments under "parameters"
        before, after = f'{{"name": {quoted}, "parameters": ', "}"
    return f"{_literal(before)} {args} {_literal(after)}"


def tool_grammar(fmt: Format, tools: list[Tool], only: str | None,
                 thinking: bool, thinking_open: bool) -> str:
    """A grammar for exactly one call of `only` (or of any tool, when None).

    `thinking`: the model may think first (a whole think block, or the rest of one
    the prompt left open), as the template's own tags delimit it."""
    wanted = [t for t in tools if only is None or t.name == only]
    if not wanted:
        raise BadRequest(f"tool_choice names {only!r}, which is not among the tools")
    grammars = pure_module("llama_grammar")
    converter = grammars.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                         raw_pattern=False)
    calls = []
    for i, tool in enumerate(wanted):
        schema = tool.parameters or dict(EMPTY_SCHEMA)
        check_schema(schema, f"the parameters of tool {tool.name!r}")
        try:
            schema = converter.resolve_refs(schema, f"tool{i}")
            args = converter.visit(schema, f"tool{i}-args")
        except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
            raise BadRequest(f"invalid parameters schema for tool {tool.name!r}: "
                             f"{exc}") from None
        calls.append(_call_rule(fmt, tool.name, args))
    root = "(" + " | ".join(calls) + ")"
    if thinking and fmt.think is not None:
        opening, closing = fmt.think
        if thinking_open:
            root = f'[^<]* {_literal(closing)} [ \\n]* {root}'
        else:
            root = f'({_literal(opening)} [^<]* {_literal(closing)} [ \\n]*)? {root}'
    return converter.format_grammar() + f"\nroot ::= {root}\n"
