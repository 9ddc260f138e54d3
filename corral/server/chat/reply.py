"""A streamed reply split into thinking, content and tool calls as the text arrives.

One state machine per reply. Text that might be the start of a tag (`<thi`,
`<tool_c`) is held back until the next piece settles it, so a tag never leaks
into content and content never waits longer than a tag's length. What the
model's template declares decides the formats:

- thinking between `<think>` and `</think>` (qwen3, deepseek-r1, magistral), or
  already open when the prompt ends with `<think>`;
- tool calls as `<tool_call>{json}</tool_call>` (Qwen, Hermes), after
  `[TOOL_CALLS]` (Mistral), or as a bare JSON object or list that opens the
  reply (Llama 3.x);
- gpt-oss's harmony channels: `analysis` is thinking, `final` is content, and
  `commentary to=functions.NAME` is a call.

Call text that does not parse as a call of a known tool becomes content, as
it was written: malformed output is never an error.
"""

from __future__ import annotations

import enum
import json
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any

from corral.runner.wire import Logprob
from corral.server.chat.messages import ToolCall
from corral.server.chat.harmony import HarmonyParser, uses_harmony


class Kind(enum.Enum):
    CONTENT = "content"
    THINKING = "thinking"
    CALL = "call"


@dataclass(frozen=True)
class Piece:
    kind: Kind
    text: str = ""
    call: ToolCall | None = None
    logprobs: tuple[Logprob, ...] = ()  # the tokens that brought this piece
    index: int = 0  # the choice it belongs to, when a request asked for n > 1


@dataclass(frozen=True)
class Format:
    think: tuple[str, str] | None = None  # opening and closing tag
    tools: str | None = None  # "tags", "mistral", "json", "harmony", or None
    harmony: bool = False


THINK_TAGS = ("<think>", "</think>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")
MISTRAL_TAG = "[TOOL_CALLS]"
MISTRAL_END = "[/TOOL_CALLS]"  # newer Mistral templates close the list; it is no content
PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return "call_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


# `tools` used in a Jinja expression or statement, not merely written in the text.
_JINJA_TOOLS = re.compile(r"\{[{%][^}]*\btools\b")


def template_thinks(template: str) -> bool:
    """A template that can open a think block: the one place this is decided."""
    return "<think>" in template or ".Think" in template or uses_harmony(template)


def template_calls_tools(template: str) -> bool:
    """A template that renders tools or calls: Go's .Tools, tool calls, or Jinja reading
    `tools` (a template that only mentions the word in its text does not)."""
    return (".Tools" in template or "tool_call" in template or MISTRAL_TAG in template
            or uses_harmony(template) or _JINJA_TOOLS.search(template) is not None)


def reply_format(template: str, think: bool, tools: bool) -> Format:
    """What to look for in a reply, from the template that made the prompt."""
    if uses_harmony(template):
        return Format(tools="harmony" if tools else None, harmony=True)
    think_tags = THINK_TAGS if think and template_thinks(template) else None
    kind = None
    if tools:
        kind = "tags" if "<tool_call>" in template else \
            "mistral" if MISTRAL_TAG in template else "json"
    return Format(think=think_tags, tools=kind)


class State(enum.Enum):
    START = "start"  # may open a think block
    THINKING = "thinking"
    CONTENT_START = "content_start"  # a JSON-format call may open the content
    CONTENT = "content"
    CALL = "call"
    AFTER_CALL = "after_call"  # a call was sent before its closing tag came: skip to it
    LIST = "list"  # inside a JSON list of calls, each sent as its object completes


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReplyParser:
    fmt: Format
    tool_names: set[str] = field(default_factory=set)
    thinking_open: bool = False  # the prompt ended inside a think block
    state: State = State.START
    buf: str = ""
    calls: int = 0
    harmony: HarmonyParser | None = None
    trim: bool = False  # whitespace after a think tag is dropped, across pieces
    closing: str | None = None  # a tag that may close the call just made (Mistral's)
    list_raw: str = ""  # the list's text so far, for when it turns out to be no calls
    list_calls: int = 0

    def __post_init__(self) -> None:
        if self.fmt.harmony:
            self.harmony = HarmonyParser(self.fmt.tools == "harmony")
        elif self.fmt.think is None:
            self.state = State.CONTENT_START
        elif self.thinking_open:
            self.state = State.THINKING

    def feed(self, text: str) -> list[Piece]:
        if self.harmony is not None:
            return [self._harmony_piece(*p) for p in self.harmony.feed(text)]
        self.buf += text
        out: list[Piece] = []
        while self.buf and self._step(out, final=False):
            pass
        return [p for p in out if p.text or p.call]

    def finish(self) -> list[Piece]:
        """The end of the reply: whatever is held back is settled now."""
        if self.harmony is not None:
            return [self._harmony_piece(*p) for p in self.harmony.finish()]
        out: list[Piece] = []
        while self.buf and self._step(out, final=True):
            pass
        if self.buf:
            kind = Kind.THINKING if self.state is State.THINKING else Kind.CONTENT
            out.append(Piece(kind, self.buf))
            self.buf = ""
        return [p for p in out if p.text or p.call]

    # ---- the transitions: each consumes some of `buf`, or returns False to wait ----------

    def _step(self, out: list[Piece], final: bool) -> bool:
        if self.trim:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.trim = False
        if self.state is State.START:
            return self._start(final)
        if self.state is State.THINKING:
            return self._thinking(out, final)
        if self.state is State.CONTENT_START:
            return self._content_start(final)
        if self.state is State.CONTENT:
            return self._content(out, final)
        if self.state is State.AFTER_CALL:
            return self._after_call(out, final)
        if self.state is State.LIST:
            return self._list(out, final)
        return self._call(out, final)

    def _start(self, final: bool) -> bool:
        assert self.fmt.think is not None
        opening = self.fmt.think[0]
        stripped = self.buf.lstrip()
        if stripped.startswith(opening):
            self.buf = stripped[len(opening):]
            self.state, self.trim = State.THINKING, True
        elif opening.startswith(stripped) and not final:
            return False  # could still be the tag
        else:
            self.state = State.CONTENT_START
        return True

    def _thinking(self, out: list[Piece], final: bool) -> bool:
        assert self.fmt.think is not None
        closing = self.fmt.think[1]
        end = self.buf.find(closing)
        if end >= 0:
            out.append(Piece(Kind.THINKING, self.buf[:end]))
            self.buf = self.buf[end + len(closing):]
            self.state, self.trim = State.CONTENT_START, True
            return True
        keep = 0 if final else _held(self.buf, closing)
        out.append(Piece(Kind.THINKING, self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _content_start(self, final: bool) -> bool:
        if self.fmt.tools == "json":
            stripped = self.buf.lstrip()
            if stripped.startswith(PYTHON_TAG):
                stripped = stripped[len(PYTHON_TAG):].lstrip()
            if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
                return False if not final else self._to_content()
            if stripped[0] in "{[":
                self.buf = stripped
                self.state = State.CALL
                return True
        return self._to_content()

    def _to_content(self) -> bool:
        self.state = State.CONTENT
        return True

    def _opening(self) -> str | None:
        return {"tags": TOOL_TAGS[0], "mistral": MISTRAL_TAG}.get(self.fmt.tools or "")

    def _content(self, out: list[Piece], final: bool) -> bool:
        if self.closing is not None:
            stripped = self.buf.lstrip()
            if stripped.startswith(self.closing):
                self.buf, self.closing = stripped[len(self.closing):], None
            elif self.closing.startswith(stripped) and not final:
                return False  # could still be the closing tag
            else:
                self.closing = None
            return bool(self.buf)
        opening = self._opening()
        if opening is None:
            out.append(Piece(Kind.CONTENT, self.buf))
            self.buf = ""
            return False
        start = self.buf.find(opening)
        if start >= 0:
            out.append(Piece(Kind.CONTENT, self.buf[:start]))
            self.buf = self.buf[start:]
            self.state = State.CALL
            return True
        keep = 0 if final else _held(self.buf, opening)
        out.append(Piece(Kind.CONTENT, self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _call(self, out: list[Piece], final: bool) -> bool:
        if self.fmt.tools == "tags":
            end = self.buf.find(TOOL_TAGS[1])
            if end < 0:
                return self._early(out) or self._unfinished(out, final)
            raw = self.buf[:end + len(TOOL_TAGS[1])]
            self.buf = self.buf[end + len(TOOL_TAGS[1]):]
            self._emit(out, raw, raw[len(TOOL_TAGS[0]):-len(TOOL_TAGS[1])])
            self.state = State.CONTENT
            return True
        if self.fmt.tools == "json" and self.buf.lstrip().startswith("["):
            self.buf, self.state = self.buf.lstrip()[1:], State.LIST
            self.list_raw, self.list_calls = "[", 0
            return True
        body = self.buf[len(MISTRAL_TAG):] if self.fmt.tools == "mistral" else self.buf
        lead = len(self.buf) - len(body.lstrip())
        try:
            value, end = json.JSONDecoder().raw_decode(body.lstrip())
        except ValueError:
            return self._unfinished(out, final)
        raw = self.buf[:lead + end]
        self.buf = self.buf[lead + end:]
        called = self._emit(out, raw, value)
        if self.fmt.tools == "mistral":
            self.state, self.closing = State.CONTENT, MISTRAL_END if called else None
        else:  # Llama: calls open the reply; JSON after text or a non-call is text, as Ollama
            self.state = State.CONTENT_START if called else State.CONTENT
        return True

    def _list(self, out: list[Piece], final: bool) -> bool:
        """A JSON list of calls (Llama): each is sent as soon as its object is complete, as
        Ollama's parser does; a list that turns out not to be calls is text."""
        s = self.buf.lstrip()
        space = self.buf[:len(self.buf) - len(s)]
        if not s:
            return self._list_text(out) if final else False
        if s[0] == "]" and self.list_calls:  # closed: a stray second "]" is no content
            self.buf, self.state, self.closing = s[1:], State.CONTENT_START, "]"
            return True
        if s[0] == "," and self.list_calls:
            self.buf, self.list_raw = s[1:], self.list_raw + space + ","
            return True
        if s[0] != "{":
            return self._list_text(out)
        try:
            value, end = json.JSONDecoder().raw_decode(s)
        except ValueError:
            return self._list_text(out) if final else False
        parts = self._parts(value)
        if parts is None:  # not a call of a known tool: text, once the reply has ended
            return self._list_text(out) if final else False
        out.append(Piece(Kind.CALL, call=self._numbered(*parts)))
        self.list_calls += 1
        self.buf, self.list_raw = s[end:], self.list_raw + space + s[:end]
        return True

    def _list_text(self, out: list[Piece]) -> bool:
        """The rest is text: all of it when no call came out of the list yet."""
        out.append(Piece(Kind.CONTENT, self.buf if self.list_calls else self.list_raw + self.buf))
        self.buf, self.state = "", State.CONTENT
        return False

    def _early(self, out: list[Piece]) -> bool:
        """A call whose JSON is complete is sent at once, before its closing tag, as
        Ollama's parser does; whatever follows up to that tag is dropped."""
        body = self.buf[len(TOOL_TAGS[0]):]
        try:
            value, end = json.JSONDecoder().raw_decode(body.lstrip())
        except ValueError:
            return False
        items = value if isinstance(value, list) else [value]
        if not items or any(self._parts(item) is None for item in items):
            return False  # not a call of a known tool: the closing tag settles it
        self._emit(out, self.buf, value)
        self.buf = body.lstrip()[end:]
        self.state = State.AFTER_CALL
        return True

    def _after_call(self, out: list[Piece], final: bool) -> bool:
        close, opening = self.buf.find(TOOL_TAGS[1]), self.buf.find(TOOL_TAGS[0])
        if close >= 0 and (opening < 0 or close < opening):
            self.buf, self.state = self.buf[close + len(TOOL_TAGS[1]):], State.CONTENT
            return True
        if opening >= 0:
            self.buf, self.state = self.buf[opening:], State.CALL
            return True
        if final:  # no closing tag came: stray brackets are dropped, anything else is text
            if self.buf.strip(" \n}]"):
                out.append(Piece(Kind.CONTENT, self.buf))
            self.buf = ""
        return False

    def _unfinished(self, out: list[Piece], final: bool) -> bool:
        if final:  # the reply ended inside a call: it was text after all
            out.append(Piece(Kind.CONTENT, self.buf))
            self.buf = ""
        return False

    def _emit(self, out: list[Piece], raw: str, body: Any) -> bool:
        """Calls for each well-formed call in `body` (True), or `raw` as content."""
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except ValueError:
                out.append(Piece(Kind.CONTENT, raw))
                return False
        items = body if isinstance(body, list) else [body]
        calls = [self._parts(item) for item in items]
        if not items or any(c is None for c in calls):
            out.append(Piece(Kind.CONTENT, raw))
            return False
        out.extend(Piece(Kind.CALL, call=self._numbered(*c)) for c in calls if c is not None)
        return True

    def _parts(self, item: Any) -> tuple[str, dict[str, Any]] | None:
        """The name and arguments of a call of a known tool, or None; numbered only when
        sent, so a list that turns out to be text takes no call index."""
        if not isinstance(item, dict):
            return None
        inner = item.get("function")
        fn: dict[str, Any] = inner if isinstance(inner, dict) else item
        name = fn.get("name")
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(name, str) or not isinstance(args, dict) or \
                (self.tool_names and name not in self.tool_names):
            return None
        return name, args

    def _numbered(self, name: str, args: dict[str, Any]) -> ToolCall:
        self.calls += 1
        return ToolCall(name, args, call_id(), self.calls - 1)

    def _harmony_piece(self, kind: str, text: str, name: str | None) -> Piece:
        if kind == "call":
            assert name is not None
            try:
                args = json.loads(text) if text.strip() else {}
            except ValueError:
                args = None
            if isinstance(args, dict) and (not self.tool_names or name in self.tool_names):
                return Piece(Kind.CALL, call=self._numbered(name, args))
            return Piece(Kind.CONTENT, text)
        return Piece(Kind.THINKING if kind == "thinking" else Kind.CONTENT, text)
