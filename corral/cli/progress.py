"""Pull and create progress: rich bars per layer on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any, Iterable

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def show_progress(events: Iterable[dict[str, Any]], console: Console | None = None) -> None:
    """Render a status stream to stderr; ends after `success` (errors raise upstream)."""
    err = console or Console(stderr=True)
    if not err.is_terminal:
        _plain(events)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn(
        "{task.percentage:>3.0f}%"), DownloadColumn(binary_units=False), TransferSpeedColumn(),
        TimeRemainingColumn())
    tasks: dict[str, TaskID] = {}
    with Progress(*columns, console=err, transient=False) as bars:
        status = None
        for event in events:
            digest = event.get("digest")
            if digest and event.get("total"):
                if digest not in tasks:
                    if not event.get("completed"):
                        continue  # hidden until bytes arrive, as Ollama does
                    tasks[digest] = bars.add_task(event["status"], total=event["total"])
                bars.update(tasks[digest], completed=event.get("completed", 0))
            elif event.get("status") and event["status"] != status:
                status = event["status"]
                bars.console.print(status)


def _plain(events: Iterable[dict[str, Any]]) -> None:
    last: dict[str, int] = {}
    for event in events:
        digest = event.get("digest")
        if digest and event.get("total"):
            pct = int(100 * event.get("completed", 0) / event["total"])
            if pct // 25 != last.get(digest, -1) // 25 or pct == 100 and last.get(digest) != 100:
                print(f"{event['status']}: {pct}%", file=sys.stderr, flush=True)
                last[digest] = pct
        elif event.get("status"):
            print(event["status"], file=sys.stderr, flush=True)
