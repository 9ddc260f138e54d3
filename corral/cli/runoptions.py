"""What `corral run` was asked for: the model and the flags that shape each request.
Its own module because the REPL and image attachment (cli.images) both read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunOptions:
    model: str
    verbose: bool = False
    format: str | None = None
    keep_alive: str | None = None
    think: bool | str | None = None
    hide_thinking: bool = False
    wordwrap: bool = True
    history: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    # what the model takes besides text ("image", "audio"), asked once when needed
    media: frozenset[str] | None = None
