"""GGUF `tokenizer.chat_template` rendering in Jinja's immutable sandbox.

Model files come from strangers, so the template is hostile until proven
otherwise: no attribute escapes (the sandbox), no huge ranges or string
products (intercepted operators), a wall-clock limit (a trace hook that stops
the render), and a cap on the output.
"""

from __future__ import annotations

import json
import mmap
import operator
import os
import sys
import time
from datetime import datetime
from types import FrameType
from typing import Any, Callable

from jinja2 import TemplateError as JinjaError
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from corral.server.chat.templates.gotemplate import TemplateError

MAX_OUTPUT = 1 << 20
MAX_SEQUENCE = 1 << 20
TIME_LIMIT = 2.0
MEMORY_LIMIT = 256 << 20
PAGE = mmap.PAGESIZE


class _Memory:
    """This process's resident bytes, from /proc/self/statm through one descriptor kept
    open for a render: it is read every fourth trace event, and an open and a close each
    time were half the render of a 34-message chat (2.1 of 4.2 ms). 0 where /proc is
    missing (the time limit still applies)."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = -1

    def rss(self) -> int:
        if self._fd < 0:
            return 0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Timeout(Exception):
    pass


class _Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**":
            if abs(left) > 1 << 16 or abs(right) > 64:
                raise SecurityError("exponent too large")
            return left ** right
        if operator_name == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > MAX_SEQUENCE:
                        raise SecurityError("sequence repetition too large")
            return left * right
        result = operator.add(left, right)
        if isinstance(result, (str, list, tuple)) and len(result) > MAX_SEQUENCE:
            raise SecurityError("concatenation too large")
        return result


def _raise(message: str) -> None:
    raise TemplateError(str(message)[:200])


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            **_: Any) -> str:
    # `x | map(...) | tojson` hands over a generator: JSON has lists.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      default=lambda v: list(v) if hasattr(v, "__iter__") else str(v))


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, which Hugging Face's renderer defines to
    mark assistant text for training masks: for a prompt it renders what it holds."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _env() -> _Env:
    # Loop controls ({% break %}, {% continue %}) are on, as in Hugging Face's renderer.
    env = _Env(trim_blocks=True, lstrip_blocks=True,
               extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_SENTINEL = "\x00corral-system\x00"


class JinjaTemplate:
    def __init__(self, source: str, time_limit: float = TIME_LIMIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.time_limit = time_limit
        self.clock = clock  # read at every trace event (tests count those reads)
        self._system: bool | None = None
        try:
            self._template = _env().from_string(source)
        except (JinjaError, SecurityError, RecursionError, MemoryError) as exc:
            raise TemplateError(f"invalid chat template: {exc}") from None

    @property
    def supports_system(self) -> bool:
        """Whether the template shows a system message's text (some raise on the role, some
        drop it): found once, by rendering a probe, as llama.cpp's chat layer does."""
        if self._system is None:
            try:
                probe = self.render(messages=[{"role": "system", "content": _SENTINEL},
                                              {"role": "user", "content": "x"}],
                                    add_generation_prompt=True, bos_token="", eos_token="")
                self._system = _SENTINEL in probe
            except TemplateError:
                self._system = False
        return self._system

    def render(self, **variables: Any) -> str:
        deadline = self.clock() + self.time_limit
        out: list[str] = []
        size = 0
        memory = _Memory()
        baseline = memory.rss()
        events = [0]

        def line(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
            # `~` concatenation cannot be intercepted, so memory is watched instead.
            events[0] += 1
            # Every fourth event: as often for a `~` doubling loop as every sixteenth was
            # when Jinja's runtime lines were traced too.
            if events[0] % 4 == 0 and baseline and memory.rss() - baseline > MEMORY_LIMIT:
                raise _Timeout("memory")
            if self.clock() > deadline:
                raise _Timeout("time")
            return line

        def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
            # Every call is checked, and every line of the template's own code (its loops
            # need no call to go round), but not the lines of Jinja's runtime: a call there
            # runs a bounded step, and tracing its lines made a chat's render 2x slower.
            line(frame, event, arg)
            return line if frame.f_code.co_filename == "<template>" else None

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for piece in self._template.generate(**variables):
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise TemplateError("chat template output is too large")
                out.append(piece)
        except _Timeout as exc:
            what = "used too much memory" if str(exc) == "memory" else "took too long"
            raise TemplateError(f"chat template {what}") from None
        except TemplateError:
            raise
        except (JinjaError, SecurityError, RecursionError, MemoryError, OverflowError) as exc:
            raise TemplateError(f"chat template failed: {exc}"[:300]) from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError,
                ZeroDivisionError) as exc:
            raise TemplateError(f"chat template failed: {exc}"[:300]) from None
        finally:
            sys.settrace(previous)
            memory.close()
        return "".join(out)
