"""What every route is handed: the store, the model views, the scheduler, the metrics
and the settings. It does nothing itself: a request goes down from its route through
the pipeline, which asks the views once and the scheduler to hold a model. It lives
with the pipeline, which is handed it too, and names the metrics only by what is
called on them (`Meter`): the pipeline imports nothing of the shell above it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from corral.config import Settings, parse_duration
from corral.errors import BadRequest
from corral.registry.store import Store
from corral.server.chat.models import Models
from corral.server.residency.scheduler import Scheduler


class Meter(Protocol):
    """The metrics as the pipeline counts them and /metrics reads them back
    (server.metrics.Metrics, which the daemon makes with the HTTP stack)."""

    def request(self, model: str, status: str) -> None: ...
    def tokens(self, model: str, prompt: int, generated: int, eval_ns: int) -> None: ...
    def drafts(self, model: str, drafted: int, accepted: int) -> None: ...
    def ttft(self, model: str, seconds: float) -> None: ...
    def render(self) -> bytes: ...


@dataclass(frozen=True)
class Services:
    store: Store
    models: Models
    scheduler: Scheduler
    metrics: Meter

    @property
    def settings(self) -> Settings:
        return self.scheduler.settings


def keep_alive_of(value: Any) -> float | None:
    """Ollama's keep_alive: a duration ("5m", "1h30m"), seconds, or negative for ever."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise BadRequest(f"invalid keep_alive duration: {value!r}") from None
