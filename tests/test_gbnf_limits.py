"""Grammars are checked before llama.cpp's recursive parser sees them (issue: a deeply
nested grammar killed the runner and every stream on it)."""

from __future__ import annotations

import pytest

from corral.errors import BadRequest
from corral.server.pipeline.gbnf import MAX_DEPTH, check_gbnf


@pytest.mark.parametrize("text", [
    'root ::= "a"',
    'root ::= ("(" | ")" | [()]) "{99999}" # ((((((( in a comment\n',  # not syntax
    'root ::= ' + "(" * MAX_DEPTH + '"a"' + ")" * MAX_DEPTH,
    'root ::= "la "{200} [a-z]{0,10000}',
    'root ::= "\\"(" x\nx ::= "\\\\" "("',  # escapes inside literals
])
def test_real_grammars_pass(text: str) -> None:
    check_gbnf(text)


@pytest.mark.parametrize("text,words", [
    ("root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000, "nests parentheses"),
    ('root ::= "a"{100001}', "repeats something 100001 times"),
    ('root ::= "a"{1,20000}', "repeats something 20000 times"),
    ("".join(f"r{i} ::= \"a\"\n" for i in range(5000)), "more than 4096 rules"),
])
def test_hostile_grammars_are_refused_by_name(text: str, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        check_gbnf(text)


def test_schema_counts_are_bounded_before_conversion() -> None:
    from corral.server.pipeline.grammar import grammar_for
    from corral.server.pipeline.gbnf import check_schema

    check_schema({"type": "string", "minLength": 3, "maxLength": 10_000})
    with pytest.raises(BadRequest, match="minLength 1000000000 is over the limit"):
        grammar_for({"type": "object", "properties": {"a": {
            "type": "string", "minLength": 10 ** 9}}}, 1 << 16)
    with pytest.raises(BadRequest, match="maxItems"):
        check_schema([{"items": {"maxItems": 10 ** 12}}])
