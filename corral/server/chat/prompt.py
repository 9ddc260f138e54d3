"""Chat messages to prompt text, through the model's template, in the daemon.

As in Ollama's server/prompt.go, the daemon renders: it knows the request, the
template and the capabilities, and reads the rendered text itself (does it end in
an open think block?). The runner receives text, whether to add BOS, and the
images for the text's media markers; it only tokenizes.

A TEMPLATE layer (Go syntax) wins; without one, the GGUF's Jinja
`tokenizer.chat_template`; without either, a plain completion-style template.
"""

from __future__ import annotations

from typing import Any

from corral.registry.models import FALLBACK_TEMPLATE
from corral.runner.wire import MARKER as MEDIA_MARKER
from corral.server.chat.messages import MEDIA_PLACE, Message, Tool
from corral.server.chat.templates.gotemplate import GoTemplate
from corral.server.chat.templates.jinja import JinjaTemplate

_SENTINEL = "\x00corral-response\x00"


def _mark(content: str, n: int) -> str:
    """Each media item where its part stood (MEDIA_PLACE); any other by Ollama's rule:
    it replaces an "[img]" in the text, else goes in front."""
    n -= content.count(MEDIA_PLACE)
    content = content.replace(MEDIA_PLACE, MEDIA_MARKER)
    prefix = ""
    for _ in range(n):
        if "[img]" in content:
            content = content.replace("[img]", MEDIA_MARKER, 1)
        else:
            prefix += MEDIA_MARKER
    return prefix + content


def mark_messages(messages: list[Message]) -> tuple[list[Message], list[str]]:
    """Messages with a media marker where each image goes, and the images (base64, as
    checked at the edge) in the order of their markers."""
    images: list[str] = []
    out = []
    for m in messages:
        images += m.images
        out.append(m.with_content(_mark(m.content, len(m.images))) if m.images else m)
    return out, images


def mark_prompt(prompt: str, images: list[str]) -> str:
    return _mark(prompt, len(images)) if images else prompt


def _go_message(m: Message) -> dict[str, Any]:
    calls = [{"Function": {"Name": c.name, "Arguments": c.arguments}} for c in m.tool_calls]
    return {"Role": m.role, "Content": m.content, "ToolCalls": calls,
            "Thinking": m.thinking, "ToolName": m.tool_name,
            "ToolCallID": m.tool_call_id, "Images": list(m.images)}


def _go_tool(t: Tool) -> dict[str, Any]:
    return {"Type": "function",
            "Function": {"Name": t.name, "Description": t.description,
                         "Parameters": t.parameters}}


def _system_into_user(messages: list[Message]) -> list[Message]:
    """For a template that cannot show a system message (Gemma's raises on the role,
    Phi-3's drops it): its text opens the next user message, as llama.cpp's chat layer
    does, so it still reaches the model."""
    out: list[Message] = []
    pending: list[str] = []
    for m in messages:
        if m.role == "system":
            pending.append(m.content)
        elif m.role == "user" and pending:
            out.append(m.with_content("\n".join(pending + [m.content])))
            pending = []
        else:
            out.append(m)
    if pending:
        out.append(Message("user", "\n".join(pending)))
    return out


def _collate(messages: list[Message]) -> tuple[str, list[Message]]:
    """Ollama's collate: system messages joined into .System; same-role runs merged."""
    system = [m.content for m in messages if m.role == "system"]
    merged: list[Message] = []
    for m in messages:
        if merged and merged[-1].role == m.role and m.role in ("user", "system"):
            merged[-1] = merged[-1].with_content(merged[-1].content + "\n\n" + m.content)
        else:
            merged.append(m)
    return "\n\n".join(system), merged


class PromptBuilder:
    def __init__(self, go_template: str | None = None, jinja_template: str | None = None,
                 bos: str = "", eos: str = "") -> None:
        self.bos, self.eos = bos, eos
        self.jinja: JinjaTemplate | None = None
        self.go: GoTemplate | None = None
        if go_template:
            self.kind, self.go = "go", GoTemplate(go_template)
        elif jinja_template:
            self.kind, self.jinja = "jinja", JinjaTemplate(jinja_template)
        else:
            self.kind, self.go = "fallback", GoTemplate(FALLBACK_TEMPLATE)

    @property
    def source(self) -> str:
        return self.go.source if self.go else self.jinja.source if self.jinja else ""

    def supports_suffix(self) -> bool:
        return self.go is not None and ".Suffix" in self.go.source

    def chat(self, messages: list[Message], tools: list[Tool] | None = None,
             think: bool | str | None = None) -> tuple[str, bool]:
        """Prompt text, and whether the tokenizer should add BOS itself.

        `think` is a bool or a level ("low", "medium", "high"): templates see both
        as Ollama's do (.Think, .ThinkLevel; Jinja's enable_thinking, reasoning_effort).
        """
        level = think if isinstance(think, str) else ""
        if self.jinja is not None:
            if not self.jinja.supports_system:
                messages = _system_into_user(messages)
            extra = {"reasoning_effort": level} if level else {}
            text = self.jinja.render(messages=[m.shown() for m in messages],
                                     tools=[t.shown() for t in tools] if tools else None,
                                     add_generation_prompt=True, bos_token=self.bos,
                                     eos_token=self.eos, enable_thinking=bool(think), **extra)
            return text, not (self.bos and text.startswith(self.bos))
        assert self.go is not None
        system, merged = _collate(messages)
        data: dict[str, Any] = {"System": system, "Tools": [_go_tool(t) for t in tools or []],
                                "Think": bool(think), "ThinkLevel": level,
                                "IsThinkSet": think is not None}
        if self.go.uses_messages:
            data["Messages"] = [_go_message(m) for m in merged]
            return self.go.render(data), True
        return self._legacy(merged, data), True

    def _legacy(self, messages: list[Message], data: dict[str, Any]) -> str:
        """Templates without .Messages run once per user turn; the last one is cut at .Response."""
        assert self.go is not None
        turns: list[tuple[str, str | None]] = []
        for m in messages:
            if m.role == "user":
                turns.append((m.content, None))
            elif m.role == "assistant":
                if turns and turns[-1][1] is None:
                    turns[-1] = (turns[-1][0], m.content)
                else:
                    turns.append(("", m.content))
        if not turns or turns[-1][1] is not None:
            turns.append(("", None))
        out = []
        for i, (prompt, response) in enumerate(turns):
            last = i == len(turns) - 1
            text = self.go.render({**data, "System": data["System"] if i == 0 else "",
                                   "Prompt": prompt,
                                   "Response": _SENTINEL if last else response or ""})
            out.append(text.split(_SENTINEL)[0] if last else text)
        return "".join(out)

    def generate(self, prompt: str, system: str | None = None,
                 suffix: str | None = None, think: bool | str | None = None) -> tuple[str, bool]:
        if suffix and self.go is not None and self.supports_suffix():
            text = self.go.render({"System": system or "", "Prompt": prompt, "Suffix": suffix,
                                   "Response": ""})
            return text, True
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
        return self.chat(messages, think=think)


