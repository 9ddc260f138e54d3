"""What the scheduler keeps per model: the runner it talks to, the model's state, and
an admitted request's ticket. Every transition between the states is in
server/residency/scheduler.py, under its lock."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from corral.options import Options
from corral.registry.models import ModelRecord
from corral.runner.rankwire import Ranked, RerankJob
from corral.runner.wire import (CompletionJob, DoneLine, EmbedJob, Embeddings, Health, LoadReport,
                               TokenLine, Tokenize)


class Runner(Protocol):
    report: LoadReport

    def start(self, timeout: float) -> LoadReport: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def end(self) -> None: ...  # stop it without a word (a failed engine exits by itself first)
    def alive(self) -> bool: ...
    def completion(self, job: CompletionJob) -> Iterator[TokenLine | DoneLine]: ...
    def cancel(self, job_id: str) -> None: ...
    def embed(self, job: EmbedJob) -> Embeddings: ...
    def rerank(self, job: RerankJob) -> Ranked: ...
    def health(self, timeout: float = 5.0) -> Health: ...
    def set_threads(self, n: int) -> None: ...
    def clear_cache(self) -> None: ...
    def tokens(self, command: Tokenize) -> list[Any]: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def count(self, job: CompletionJob) -> int: ...


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


@dataclass
class Resident:
    """A model the scheduler has loaded, is loading or is unloading, with its runner."""

    record: ModelRecord
    options: Options  # the load-time options it was loaded with
    slots: int
    runner: Runner | None = None
    state: ModelState = ModelState.LOADING
    refcount: int = 0
    keep_alive: float = 300.0
    expires_at: float | None = None  # wall clock; None while busy or forever
    reload: bool = False
    inflight: int = 0  # admitted requests, running or queued in the runner
    threads: int = 0  # its share of the cores, last told (server.residency.threads); 0: not yet
    health: Health | None = None  # the runner's last answer to a health check
    silent_since: float | None = None  # the first health check unanswered since then

    @property
    def key(self) -> str:
        return self.record.digest


@dataclass
class Ticket:
    """An admitted request: counted against a loaded model, or as pending a load."""

    entry: Resident | None
    settled: bool = False
