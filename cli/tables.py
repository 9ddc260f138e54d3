"""Ollama-style tables: no borders, left-aligned, a 4-space gap, uppercase headers."""

from __future__ import annotations

import time
from typing import Sequence

import typer

from registry.store import ModelEntry


def human_bytes(n: float) -> str:
    """Decimal units as Ollama prints them: 253 MB, 2.0 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.0f} {unit}" if n >= 10 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} TB"


def human_ago(then: float, now: float | None = None) -> str:
    delta = max(0.0, (time.time() if now is None else now) - then)
    for size, unit in ((86400 * 365, "year"), (86400 * 30, "month"), (86400 * 7, "week"),
                       (86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if delta >= size:
            n = int(delta // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "Less than a second ago"


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)]
        lines.append("    ".join(cells).rstrip())
    return "\n".join(lines)


def print_models(entries: Sequence[ModelEntry]) -> None:
    rows = [
        [e.name.display(), e.digest[:12], human_bytes(e.size), human_ago(e.modified_at)]
        for e in sorted(entries, key=lambda e: -e.modified_at)
    ]
    typer.echo(render(["NAME", "ID", "SIZE", "MODIFIED"], rows))
