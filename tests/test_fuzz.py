"""Fuzzing the native boundary through the daemon, against a real runner.

Random and adversarial GBNF grammars, JSON schemas (`format`), tool definitions
with forced calls, and Go templates go in: a fixed number of cases from a fixed seed, so a
run checks the same inputs on any machine, however fast.
Every answer must be 2xx or 4xx; the runner process must be the same one at the
end (nothing crashed it); and a greedy probe must answer as it did before. The
corpus at the top keeps every input that ever crashed something.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable, Iterator

import httpx
import pytest

from corral.registry.create import CreateRequest, create_model
from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import start_daemon
from tests.test_reasoning import TEMPLATE

pytestmark = pytest.mark.model

CHAT, TOOLY = "smollm2:135m", "fuzz-tools"
SEED, CASES = 20261201, 30  # random cases after the corpus: the same 30 on every machine

# Inputs that once took a runner down (or would have): kept forever.
CORPUS: list[tuple[str, dict[str, Any]]] = [
    ("grammar", {"grammar": "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000}),
    ("grammar", {"grammar": 'root ::= "a"{1,1000000}'}),
    ("grammar", {"grammar": "root ::= root \"a\""}),  # left recursion
    ("grammar", {"grammar": 'root ::= ("")*'}),
    ("grammar", {"grammar": "root ::= [z-a]"}),
    ("grammar", {"grammar": 'root ::= "\\'}),
    ("format", {"format": {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#"}}}}),
    ("format", {"format": {"type": "string", "pattern": "((((("}}),
    ("format", {"format": {"type": "string", "minLength": 10 ** 9}}),
]


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # Room for every fuzzed template's model beside the chat starter: an eviction would
    # change the runner's pid without anything having crashed.
    d = start_daemon(starter_store, tmp_path_factory.mktemp("fuzz"), NUM_PARALLEL="2",
                     MAX_LOADED_MODELS="8")
    create_model(d.store, CreateRequest(model=TOOLY, from_=CHAT, template=TEMPLATE))
    yield d
    d.shutdown()


def _gbnf(rng: random.Random) -> str:
    """A random grammar: mostly well-formed, sometimes deep, wide, repeated or broken."""
    def term(depth: int) -> str:
        roll = rng.random()
        if depth > 0 and roll < 0.3:
            return "(" + " | ".join(term(depth - 1) for _ in range(rng.randint(1, 3))) + ")"
        if roll < 0.5:
            return json.dumps("".join(rng.choice("ab ") for _ in range(rng.randint(0, 4))))
        if roll < 0.7:
            return "[" + rng.choice(["a-z", "^x", "0-9", "\\n", "z-a", "]"]) + "]"
        return rng.choice(["x", "y", "root", "undefined"])
    rules = [f"root ::= {term(rng.randint(0, 6))}{rng.choice(['', '*', '+', '?', '{2}', '{0,3}'])}",
             f"x ::= {term(3)}", f"y ::= {term(2)} x?"]
    text = "\n".join(rules)
    mutation = rng.random()
    if mutation < 0.1:
        d = rng.choice([300, 5000, 20_000])
        text = "root ::= " + "(" * d + '"a"' + ")" * d
    elif mutation < 0.2:
        text = text[:rng.randint(0, len(text))]  # cut anywhere
    elif mutation < 0.25:
        text += f' z ::= "a"{{{rng.choice([10, 10_001, 99_999])}}}'
    return text


def _schema(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["string", "integer", "number", "boolean", "null", "object", "array", "weird"]
    kind = rng.choice(kinds if depth < 8 else kinds[:5])
    if kind == "object":
        props = {f"p{i}": _schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        return {"type": "object", "properties": props, "required": list(props)[:1]}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1),
                "minItems": rng.choice([0, 1, 10 ** 6]), "maxItems": rng.choice([2, 3])}
    if kind == "weird":
        return rng.choice([{"enum": [1, "a", None, [1]]}, {"anyOf": []}, {"type": "string",
                           "pattern": "[a-"}, {"$ref": "#/nope"}, {"type": ["string", 5]},
                           {"const": {"a": [1, {"b": 2}]}}, "not a schema", 42])
    return {"type": kind}


def _go_template(rng: random.Random) -> str:
    parts = ["{{ .Prompt }}", "{{ range .Messages }}{{ .Content }}{{ end }}", "{{ if .System }}",
             "{{ end }}", "{{ .Nope }}", "{{ range $i, $m := .Messages }}", "{{ len .Messages }}",
             "{{ slice .Messages 1 }}", "{{ index .Messages 99 }}", "{{", "}}", "text", "{{/* */}}"]
    return "".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))


def _cases(rng: random.Random, url: str) -> Callable[[], tuple[str, httpx.Response]]:
    def one() -> tuple[str, httpx.Response]:
        kind = rng.choice(["grammar", "format", "tools", "template"])
        base = {"stream": False, "options": {"num_predict": 4, "temperature": 0}}
        if kind == "grammar":
            body = {"model": CHAT, "prompt": "Hi", **base, "grammar": _gbnf(rng)}
            return kind, httpx.post(url + "/api/generate", json=body, timeout=120)
        if kind == "format":
            body = {"model": CHAT, "prompt": "Hi", **base, "format": _schema(rng)}
            return kind, httpx.post(url + "/api/generate", json=body, timeout=120)
        if kind == "tools":
            tool = {"type": "function", "function": {"name": "f", "parameters": _schema(rng)}}
            body = {"model": TOOLY, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 16, "tools": [tool],
                    "tool_choice": rng.choice(["required", "auto", "none"])}
            return kind, httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        name = f"fuzz-t{rng.randint(0, 3)}"
        made = httpx.post(url + "/api/create", timeout=120, json={
            "model": name, "from": CHAT, "template": _go_template(rng), "stream": False})
        if made.status_code != 200:
            return kind, made
        body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], **base}
        return kind, httpx.post(url + "/api/chat", json=body, timeout=120)
    return one


def _probe(url: str) -> str:
    r = httpx.post(url + "/api/generate", timeout=120, json={
        "model": CHAT, "prompt": "The capital of France is", "raw": True, "stream": False,
        "options": {"num_predict": 8, "temperature": 0, "seed": 1}})
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


def _runner_pid(d: Daemon) -> int:
    [pid] = [m.runner.pid for m in d.scheduler.loaded.values()
             if m.runner is not None and m.record.name.display() == CHAT]
    return int(pid)


def test_nothing_reaches_native_code_unchecked(daemon: Daemon) -> None:
    before, pid = _probe(daemon.url), _runner_pid(daemon)
    seen: dict[str, set[int]] = {}
    for kind, fields in CORPUS:
        body = {"model": CHAT, "prompt": "Hi", "stream": False,
                "options": {"num_predict": 4}, **fields}
        r = httpx.post(daemon.url + "/api/generate", json=body, timeout=120)
        assert r.status_code < 500, (kind, fields, r.text)
        seen.setdefault(kind, set()).add(r.status_code)
    one = _cases(random.Random(SEED), daemon.url)
    for n in range(CASES):
        kind, r = one()
        assert r.status_code < 500, (kind, n, r.text)
        seen.setdefault(kind, set()).add(r.status_code)
    assert _runner_pid(daemon) == pid  # the same runner: nothing crashed it
    assert _probe(daemon.url) == before  # and it answers as it did
    # Every kind came up, and some were refused and some answered.
    assert set(seen) == {"grammar", "format", "tools", "template"}, seen
    assert {400, 200} <= set().union(*seen.values()), seen
