"""A request's grammar: a raw GBNF `grammar` (a Corral extension) or the grammar of
Ollama's `format` ("json" or a JSON schema), checked before llama.cpp sees it.
A `tool_choice` grammar is made per prompt, in toolgrammar.py."""

from __future__ import annotations

import json
from typing import Any

from corral.errors import BadRequest
from corral.server.pipeline.gbnf import check_gbnf, check_schema


def grammar_for(fmt: Any, max_bytes: int) -> str | None:
    """Ollama's `format`: "json", a JSON schema object, or nothing."""
    if fmt in (None, "", "null"):
        return None
    from corral.runner.llama.capi import pure_module

    grammars = pure_module("llama_grammar")  # not `import llama_cpp`: see pure_module
    if fmt == "json":
        return str(grammars.JSON_GBNF)
    if isinstance(fmt, dict):
        check_schema(fmt, "the JSON schema in format")
        if len(json.dumps(fmt)) > max_bytes:
            raise BadRequest(f"the JSON schema in format is over the limit of {max_bytes} bytes"
                             " (CORRAL_MAX_GRAMMAR_BYTES)")
        try:
            return str(grammars.json_schema_to_gbnf(json.dumps(fmt)))
        except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
            raise BadRequest(f"invalid JSON schema in format: {exc}") from None
    raise BadRequest("invalid format")


def request_grammar(raw: str | None, fmt: Any, max_bytes: int) -> str | None:
    """A raw GBNF `grammar` or the grammar of a `format`; not both. Either is scanned
    (gbnf.check_gbnf) here; a raw grammar parses when its job starts (a 400 if not)."""
    if raw in (None, ""):
        grammar = grammar_for(fmt, max_bytes)
    else:
        if fmt not in (None, "", "null"):
            raise BadRequest("give either a format or a grammar, not both")
        if len(str(raw).encode()) > max_bytes:
            raise BadRequest(f"grammar is over the limit of {max_bytes} bytes "
                             "(CORRAL_MAX_GRAMMAR_BYTES)")
        grammar = str(raw)
    if grammar is not None:
        check_gbnf(grammar)  # before llama.cpp's recursive parser sees it
    return grammar
