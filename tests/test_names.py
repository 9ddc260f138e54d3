"""Model name grammar: defaults, shortest display, case-insensitive keys, rejection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.errors import InvalidName
from corral.registry.names import parse_name


@pytest.mark.parametrize("text,full,short", [
    ("llama3.2", "registry.ollama.ai/library/llama3.2:latest", "llama3.2:latest"),
    ("llama3.2:1b", "registry.ollama.ai/library/llama3.2:1b", "llama3.2:1b"),
    ("mattw/pygmalion", "registry.ollama.ai/mattw/pygmalion:latest", "mattw/pygmalion:latest"),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
     "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
     "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"),
    ("localhost:5000/ns/m:t", "localhost:5000/ns/m:t", "localhost:5000/ns/m:t"),
    ("http://localhost:5000/ns/m", "localhost:5000/ns/m:latest", "localhost:5000/ns/m:latest"),
    ("registry.ollama.ai/library/gemma3:270m-base", "registry.ollama.ai/library/gemma3:270m-base",
     "gemma3:270m-base"),
])
def test_parse_and_display(text: str, full: str, short: str) -> None:
    name = parse_name(text)
    assert name.full() == full
    assert name.display() == short


def test_scheme_and_case_insensitive_key() -> None:
    assert parse_name("http://localhost:5000/ns/m").scheme == "http"
    assert parse_name("Llama3.2:Latest").key() == parse_name("llama3.2").key()


@pytest.mark.parametrize("bad", [
    "", "../x", "/abs", "a/b/c/d/e", "name:tag:tag", "has space", "tab\tname", "nul\x00x",
    "x" * 1000, "m:" + "t" * 81, "n" * 81, "ns" * 41 + "/m", ":tag", "ns/:tag", "a//b",
    "model:", "llаma",  # Cyrillic 'а'
    "-lead", "ns/.hidden", "..", "ns/..", "m:..", "h/ns.x/m",
])
def test_rejects_invalid_names(bad: str) -> None:
    with pytest.raises(InvalidName):
        parse_name(bad)


FIRST = "[A-Za-z0-9_]"
part = lambda rest, n: st.from_regex(rf"\A{FIRST}{rest}{{0,{n}}}\Z", fullmatch=True)  # noqa: E731


@given(
    host=part(r"[A-Za-z0-9_.-]", 30),
    ns=part(r"[A-Za-z0-9_-]", 79),
    model=part(r"[A-Za-z0-9_.-]", 79),
    tag=part(r"[A-Za-z0-9_.-]", 79),
)
def test_round_trip(host: str, ns: str, model: str, tag: str) -> None:
    if "." in (model, tag) or model == ".." or tag == "..":
        return
    name = parse_name(f"{host}/{ns}/{model}:{tag}")
    assert (name.host, name.namespace, name.model, name.tag) == (host, ns, model, tag)
    assert parse_name(name.full()) == name
    assert parse_name(name.display()).key() == name.key()


@given(st.text(max_size=200))
def test_parser_never_crashes(text: str) -> None:
    try:
        name = parse_name(text)
    except InvalidName:
        return
    for piece in name.parts():
        assert piece and "/" not in piece and piece not in (".", "..") and "\x00" not in piece
