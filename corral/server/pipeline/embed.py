"""`embed(services, view, inputs, ...)`: the one embedding path, for both APIs."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from corral.errors import BadRequest
from corral.runner.wire import EmbedJob, Embeddings
from corral.server.chat.models import ModelView

if TYPE_CHECKING:
    from corral.server.pipeline.services import Services


def embed(services: Services, view: ModelView, inputs: list[str], options: Any,
          keep_alive: float | None, truncate: bool = True, normalize: bool = True,
          dimensions: int = 0,
          on_disconnect: Callable[[Callable[[], None]], Any] | None = None,
          ) -> tuple[Embeddings, float]:
    """The runner's embeddings and the seconds spent getting the model ready."""
    settings = services.settings
    if view.rerank:
        raise BadRequest(f"{view.name} is a reranker: it scores documents against a query "
                         "(POST /v1/rerank) and does not embed")
    if len(inputs) > settings.max_embed_inputs:
        raise BadRequest(f"too many inputs: {len(inputs)} is over the limit of "
                         f"{settings.max_embed_inputs} (CORRAL_MAX_EMBED_INPUTS)")
    start = time.perf_counter()
    job_id = uuid.uuid4().hex
    with services.scheduler.hold(view.record, view.options(options), keep_alive) as entry:
        load = time.perf_counter() - start
        runner = entry.runner
        assert runner is not None
        # A client that leaves stops the batch at the runner's next slice.
        watcher = on_disconnect(lambda: runner.cancel(job_id)) if on_disconnect else None
        try:
            result = runner.embed(EmbedJob(tuple(inputs), truncate, normalize, dimensions,
                                           settings.max_embed_tokens, job_id))
        finally:
            if watcher is not None:
                watcher.set()
    return result, load
