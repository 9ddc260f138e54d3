"""An interpreter for the subset of Go's text/template that Ollama model templates use.

Supported: text with `{{ }}` actions and `{{-`/`-}}` trim markers, comments,
fields (`.A.B`), variables (`$`, `$x`, `$x.A`), `if`/`else if`/`else`, `range`
(with `$i, $m :=`), `with`, `$x := ...` / `$x = ...`, `break`/`continue`,
parenthesised pipelines, `|`, and the functions below. Anything else is a
TemplateError when the template is loaded, never a wrong prompt later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from corral.server.chat.templates.gofuncs import FUNCS, TemplateError, _show, truthy

__all__ = ["GoTemplate", "TemplateError", "truthy"]


# ---- lexing ------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<decl>:=)
  | (?P<assign>=)
  | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[(),|])
""", re.X)


def _lex(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise TemplateError(f"unexpected {text[pos:pos + 10]!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
    return out


# ---- AST ----------------------------------------------------------------------------------

@dataclass
class Cmd:
    """One command of a pipeline: a function call or a single operand."""

    parts: list[Any]


@dataclass
class Pipe:
    cmds: list[Cmd]
    decl: list[str] = field(default_factory=list)
    assign: bool = False


@dataclass
class Chain:
    """Field access on a parenthesised pipeline: `(index .Messages 0).Content`."""

    pipe: Pipe
    fields: str


@dataclass
class Node:
    kind: str  # text, action, if, range, with, break, continue
    text: str = ""
    pipe: Pipe | None = None
    body: list["Node"] = field(default_factory=list)
    orelse: list["Node"] = field(default_factory=list)


class _Parser:
    def __init__(self, source: str) -> None:
        self.items = self._split(source)
        self.pos = 0

    @staticmethod
    def _split(source: str) -> list[tuple[str, str]]:
        items: list[tuple[str, str]] = []
        pos = 0
        for m in _ACTION.finditer(source):
            text = source[pos:m.start()]
            if m.group(1):
                text = text.rstrip()
            if items and items[-1][0] == "trim-right":
                items.pop()
                text = text.lstrip()
            items.append(("text", text))
            body = m.group(2).strip()
            if not (body.startswith("/*") and body.endswith("*/")):
                items.append(("action", body))
            if m.group(3):
                items.append(("trim-right", ""))
            pos = m.end()
        tail = source[pos:]
        if items and items[-1][0] == "trim-right":
            items.pop()
            tail = tail.lstrip()
        if "{{" in tail:
            raise TemplateError("unclosed action")
        items.append(("text", tail))
        return [i for i in items if i != ("text", "")]

    def parse(self, stop: tuple[str, ...] = ()) -> tuple[list[Node], str]:
        nodes: list[Node] = []
        while self.pos < len(self.items):
            kind, body = self.items[self.pos]
            self.pos += 1
            if kind == "text":
                nodes.append(Node("text", text=body))
                continue
            word = body.split(None, 1)[0] if body else ""
            if word in stop or (word == "else" and "else" in stop):
                return nodes, body
            if word in ("if", "with"):
                nodes.append(self._branch(word, body[len(word):]))
            elif word == "range":
                node = Node("range", pipe=self._pipe(body[5:], allow_decl=True))
                node.body, end = self.parse(("end", "else"))
                if end.startswith("else"):
                    node.orelse, end = self.parse(("end",))
                nodes.append(node)
            elif word in ("break", "continue") and body == word:
                nodes.append(Node(word))
            elif word in ("end", "else"):
                raise TemplateError(f"unexpected {{{{{word}}}}}")
            elif word in ("define", "template", "block"):
                raise TemplateError(f"unsupported action {word!r}")
            else:
                nodes.append(Node("action", pipe=self._pipe(body, allow_decl=True)))
        if stop:
            raise TemplateError("missing {{end}}")
        return nodes, ""

    def _branch(self, word: str, rest: str) -> Node:
        node = Node(word, pipe=self._pipe(rest))
        node.body, end = self.parse(("end", "else"))
        if end.startswith("else"):
            tail = end[4:].strip()
            if tail.startswith(("if ", "with ")):
                sub_word = tail.split(None, 1)[0]
                node.orelse = [self._branch(sub_word, tail[len(sub_word):])]
                return node
            if tail:
                raise TemplateError(f"unexpected {tail!r} after else")
            node.orelse, end = self.parse(("end",))
        return node

    def _pipe(self, text: str, allow_decl: bool = False) -> Pipe:
        tokens = _lex(text)
        if not tokens:
            raise TemplateError("missing value")
        pipe = Pipe([])
        for i, (kind, _) in enumerate(tokens):
            if kind in ("decl", "assign"):
                names = [v for k, v in tokens[:i] if k == "var"]
                if not allow_decl or not names or any(k not in ("var", "punct")
                                                      for k, _ in tokens[:i]):
                    raise TemplateError("bad variable declaration")
                pipe.decl, pipe.assign, tokens = names, kind == "assign", tokens[i + 1:]
                break
        pos = 0
        cmd: list[Any] = []
        while pos < len(tokens):
            kind, value = tokens[pos]
            pos += 1
            if kind == "punct" and value == "|":
                pipe.cmds.append(Cmd(cmd))
                cmd = []
            elif kind == "punct" and value == "(":
                depth, start = 1, pos
                while pos < len(tokens) and depth:
                    depth += {"(": 1, ")": -1}.get(tokens[pos][1], 0) if tokens[pos][0] == "punct" else 0
                    pos += 1
                if depth:
                    raise TemplateError("unclosed (")
                sub = " ".join(v for _, v in tokens[start:pos - 1])
                if pos < len(tokens) and tokens[pos][0] == "field" and tokens[pos][1] != ".":
                    cmd.append(Chain(self._pipe(sub), tokens[pos][1]))
                    pos += 1
                else:
                    cmd.append(self._pipe(sub))
            elif kind == "punct":
                raise TemplateError(f"unexpected {value!r}")
            else:
                cmd.append((kind, value))
        if not cmd:
            raise TemplateError("missing command")
        pipe.cmds.append(Cmd(cmd))
        for c in pipe.cmds:
            head = c.parts[0]
            if isinstance(head, tuple) and head[0] == "ident" and head[1] not in FUNCS \
                    and head[1] not in ("true", "false", "nil"):
                raise TemplateError(f'function "{head[1]}" not defined')
        return pipe


# ---- execution ------------------------------------------------------------------------

class _Break(Exception):
    pass


class _Continue(Exception):
    pass


MAX_OUTPUT = 1 << 22


class GoTemplate:
    def __init__(self, source: str) -> None:
        self.source = source
        self.nodes, _ = _Parser(source).parse()
        self.uses_messages = bool(re.search(r"\.Messages\b", source))

    def render(self, data: dict[str, Any]) -> str:
        out: list[str] = []
        self._exec(self.nodes, data, [{"$": data}], out)
        return "".join(out)

    def _exec(self, nodes: list[Node], dot: Any, scopes: list[dict[str, Any]],
              out: list[str]) -> None:
        for node in nodes:
            if node.kind == "text":
                out.append(node.text)
            elif node.kind == "action":
                assert node.pipe is not None
                value = self._pipe(node.pipe, dot, scopes)
                if not node.pipe.decl:
                    out.append(_show(value))
            elif node.kind in ("if", "with"):
                assert node.pipe is not None
                value = self._pipe(node.pipe, dot, scopes)
                branch = node.body if truthy(value) else node.orelse
                inner = value if node.kind == "with" and truthy(value) else dot
                self._exec(branch, inner, scopes + [{}], out)
            elif node.kind == "range":
                self._range(node, dot, scopes, out)
            elif node.kind == "break":
                raise _Break()
            elif node.kind == "continue":
                raise _Continue()
            if sum(len(s) for s in out) > MAX_OUTPUT:
                raise TemplateError("output too large")

    def _range(self, node: Node, dot: Any, scopes: list[dict[str, Any]], out: list[str]) -> None:
        assert node.pipe is not None
        pipe = Pipe(node.pipe.cmds)
        items = self._pipe(pipe, dot, scopes)
        if isinstance(items, dict):
            pairs = list(sorted(items.items()))
        elif isinstance(items, (list, tuple, str)):
            pairs = list(enumerate(items))
        elif isinstance(items, int) and not isinstance(items, bool):
            pairs = [(i, i) for i in range(min(items, 1 << 16))]
        elif items is None:
            pairs = []
        else:
            raise TemplateError(f"range can't iterate over {type(items).__name__}")
        if not pairs:
            self._exec(node.orelse, dot, scopes + [{}], out)
            return
        names = node.pipe.decl
        for key, value in pairs:
            scope: dict[str, Any] = {}
            if len(names) == 1:
                scope[names[0]] = value
            elif len(names) == 2:
                scope[names[0]], scope[names[1]] = key, value
            try:
                self._exec(node.body, value, scopes + [scope], out)
            except _Break:
                break
            except _Continue:
                continue

    def _pipe(self, pipe: Pipe, dot: Any, scopes: list[dict[str, Any]]) -> Any:
        value: Any = None
        for i, cmd in enumerate(pipe.cmds):
            extra = [value] if i > 0 else []
            value = self._cmd(cmd, dot, scopes, extra)
        if pipe.decl:
            if pipe.assign:
                for scope in reversed(scopes):
                    if pipe.decl[-1] in scope:
                        scope[pipe.decl[-1]] = value
                        break
                else:
                    raise TemplateError(f"undefined variable {pipe.decl[-1]}")
            else:
                scopes[-1][pipe.decl[-1]] = value
        return value

    def _cmd(self, cmd: Cmd, dot: Any, scopes: list[dict[str, Any]], extra: list[Any]) -> Any:
        head = cmd.parts[0]
        if isinstance(head, tuple) and head[0] == "ident" and head[1] in FUNCS:
            args = [self._operand(p, dot, scopes) for p in cmd.parts[1:]] + extra
            try:
                return FUNCS[head[1]](*args)
            except TemplateError:
                raise
            except Exception as exc:  # noqa: BLE001 - wrong arity or types in the template
                raise TemplateError(f"error calling {head[1]}: {exc}") from None
        if len(cmd.parts) > 1 or extra:
            raise TemplateError("can't give argument to non-function")
        return self._operand(head, dot, scopes)

    def _operand(self, part: Any, dot: Any, scopes: list[dict[str, Any]]) -> Any:
        if isinstance(part, Pipe):
            return self._pipe(part, dot, scopes)
        if isinstance(part, Chain):
            return _fields(self._pipe(part.pipe, dot, scopes), part.fields)
        kind, text = part
        if kind == "str":
            try:
                return json.loads(text)
            except ValueError:
                raise TemplateError(f"bad string {text}") from None
        if kind == "raw":
            return text[1:-1]
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "ident":
            if text in ("true", "false"):
                return text == "true"
            if text == "nil":
                return None
            raise TemplateError(f"{text} is not a value")
        if kind == "field":
            return _fields(dot, text)
        if kind == "var":
            name, _, rest = text.partition(".")
            for scope in reversed(scopes):
                if name in scope:
                    return _fields(scope[name], "." + rest) if rest else scope[name]
            raise TemplateError(f"undefined variable {name}")
        raise TemplateError(f"unexpected {text!r}")


def _fields(value: Any, chain: str) -> Any:
    if chain == ".":
        return value
    for name in chain.strip(".").split("."):
        if isinstance(value, dict):
            value = value.get(name)
        elif value is None:
            return None
        else:
            raise TemplateError(f"can't evaluate field {name}")
    return value
