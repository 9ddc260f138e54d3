"""`rerank(services, view, query, documents, ...)`: the one reranking path, for the Jina
(llama-server) and Cohere shapes. The runner scores every document of a request as
parallel sequences of its embedding batches (runner/llama/embedding.py, runner/llama/rerank.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from corral.errors import BadRequest
from corral.runner.rankwire import RerankJob
from corral.server.chat.models import ModelView

if TYPE_CHECKING:
    from corral.server.pipeline.services import Services


@dataclass(frozen=True)
class Ranking:
    """Documents by relevance, best first: (index sent, score), at most top_n of them."""

    order: list[tuple[int, float]]
    prompt_tokens: int


def rerank(services: Services, view: ModelView, query: str, documents: list[str],
           top_n: int | None, keep_alive: float | None,
           on_disconnect: Callable[[Callable[[], None]], Any] | None = None) -> Ranking:
    """Score `documents` against `query` on a reranker, or a 400 naming what is wrong."""
    check(services, view, query, documents)
    job_id = uuid.uuid4().hex
    with services.scheduler.hold(view.record, view.options(None), keep_alive) as entry:
        runner = entry.runner
        assert runner is not None
        # A client that leaves stops the batch at the runner's next slice.
        watcher = on_disconnect(lambda: runner.cancel(job_id)) if on_disconnect else None
        try:
            ranked = runner.rerank(RerankJob(query, tuple(documents), job_id,
                                             services.settings.max_embed_tokens))
        finally:
            if watcher is not None:
                watcher.set()
    return Ranking(order(ranked.scores, top_n), ranked.prompt_eval_count)


def check(services: Services, view: ModelView, query: str, documents: list[str]) -> None:
    """Everything that needs no model loaded: a reranker, a query, 1 to the limit of
    documents (CORRAL_MAX_EMBED_INPUTS, the embedding routes' limit of inputs)."""
    if "rerank" not in view.capabilities:
        raise BadRequest(f"{view.name} is not a reranker: reranking needs a model with rank "
                         "pooling (bge-reranker, jina-reranker, Qwen3-Reranker)")
    if not query:
        raise BadRequest("query must not be empty")
    if not documents:
        raise BadRequest("documents must be a non-empty list")
    limit = services.settings.max_embed_inputs
    if len(documents) > limit:
        raise BadRequest(f"too many documents: {len(documents)} is over the limit of {limit} "
                         "(CORRAL_MAX_EMBED_INPUTS)")


def order(scores: list[float], top_n: int | None) -> list[tuple[int, float]]:
    """(index, score) by score, best first, ties in the order sent; the first top_n."""
    ranked = sorted(enumerate(scores), key=lambda pair: -pair[1])
    return ranked[:top_n] if top_n is not None else ranked
