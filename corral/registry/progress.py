"""How pulls and creates report progress: one callback that takes an Ollama status object."""

from __future__ import annotations

from typing import Any, Callable

Progress = Callable[[dict[str, Any]], None]


def quiet(event: dict[str, Any]) -> None:
    """The progress callback for callers that show none."""
