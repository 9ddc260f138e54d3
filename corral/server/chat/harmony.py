"""gpt-oss's harmony format, parsed as it streams.

A reply is a run of messages, each `<|start|>assistant<|channel|>NAME[ to=functions.X]
[<|constrain|>json]<|message|>BODY` ended by `<|end|>`, `<|call|>` or `<|return|>`
(the first message may start at `<|channel|>`, since the prompt ends with
`<|start|>assistant`). The `analysis` channel is thinking, `final` is content,
and a message addressed `to=functions.X` is a call of tool X whose body is its
JSON arguments. Text outside any message is content.
"""

from __future__ import annotations

import enum
import re

def uses_harmony(template: str) -> bool:
    """Whether a model speaks harmony (gpt-oss): its template writes channel markers."""
    return "<|channel|>" in template


MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
           "<|constrain|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")

Part = tuple[str, str, "str | None"]  # (kind: thinking|content|call, text, tool name)


class Where(enum.Enum):
    OUTSIDE = "outside"
    HEADER = "header"  # between <|start|>/<|channel|> and <|message|>
    BODY = "body"


def _held(text: str) -> int:
    """Trailing characters of `text` that could begin a marker."""
    for n in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


class HarmonyParser:
    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.where = Where.OUTSIDE
        self.header = ""
        self.buf = ""
        self.call_body = ""  # a call's arguments arrive whole, at its end marker

    def _channel(self) -> tuple[str, str | None]:
        match = _RECIPIENT.search(self.header)
        if match and self.tools:
            return "call", match.group(1)
        return ("thinking" if "analysis" in self.header else "content"), None

    def feed(self, text: str, final: bool = False) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        while True:
            at, marker = self._next_marker()
            if marker is None:
                keep = 0 if final else _held(self.buf)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return [e for e in out if e[1] or e[0] == "call"]
            self._text(self.buf[:at], out)
            self.buf = self.buf[at + len(marker):]
            self._marker(marker, out)

    def finish(self) -> list[Part]:
        out = self.feed("", final=True)
        if self.where is Where.BODY and self.call_body:
            out.append(("content", self.call_body, None))  # a call cut off: its text stays
        return out

    def _next_marker(self) -> tuple[int, str | None]:
        found = [(self.buf.find(m), m) for m in MARKERS if m in self.buf]
        if not found:
            return -1, None
        return min(found)

    def _text(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        if self.where is Where.HEADER:
            self.header += text
        elif self.where is Where.BODY:
            kind, name = self._channel()
            if kind == "call":
                self.call_body += text
            else:
                out.append((kind, text, None))
        else:
            out.append(("content", text, None))

    def _marker(self, marker: str, out: list[Part]) -> None:
        if marker in ("<|start|>", "<|channel|>"):
            if self.where is not Where.HEADER:
                self.header = ""
            self.where = Where.HEADER
            if marker == "<|channel|>":
                self.header += " channel:"
        elif marker == "<|constrain|>":
            self.header += " constrain:"
        elif marker == "<|message|>":
            self.where = Where.BODY
            self.call_body = ""
        else:  # <|end|>, <|call|>, <|return|>: the message is over
            if self.where is Where.BODY:
                kind, name = self._channel()
                if kind == "call":
                    out.append(("call", self.call_body, name))
            self.where, self.header, self.call_body = Where.OUTSIDE, "", ""
