"""What every route is handed: the store, the model views, the scheduler, the metrics
and the settings. It does nothing itself: a request goes down from its route through
the pipeline (pipeline/), which asks the views once and the scheduler to hold a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corral.config import Settings, parse_duration
from corral.errors import BadRequest
from corral.registry.store import Store
from corral.server.chat.models import Models
from corral.server.residency.scheduler import Scheduler

if TYPE_CHECKING:
    from corral.server.metrics import Metrics  # imported with the HTTP stack (metrics.py)


@dataclass(frozen=True)
class Services:
    store: Store
    models: Models
    scheduler: Scheduler
    metrics: Metrics

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
