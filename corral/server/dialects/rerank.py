"""Reranking over HTTP: Jina's shape on /v1/rerank (and llama-server's aliases /rerank and
/v1/reranking), Cohere's v2 shape on /v2/rerank.

    POST /v1/rerank {model, query, documents, top_n?, return_documents?}
      -> {model, object: "list", usage: {prompt_tokens, total_tokens},
          results: [{index, relevance_score, document?: {text}}]}   (best first)
    POST /v2/rerank {model, query, documents, top_n?}
      -> {id, results: [{index, relevance_score}], meta: {api_version, billed_units}}

A score is llama-server's: the reranker's pooled classifier output for the document
(server/pipeline/rerank.py). Errors are OpenAI's shape on the llama-server routes and
Cohere's ({"message"}) on /v2 (server/asgi.shape_of).
"""

from __future__ import annotations

import uuid
from typing import Callable

from corral.api.wire import parse
from corral.api.wire.rerank import CohereRerank, JinaRerank, RerankRequest, RerankResult
from corral.server.http import Handler, Request
from corral.server.chat.models import require_model
from corral.server.pipeline.rerank import Ranking, rerank
from corral.server.pipeline.services import Services, keep_alive_of

Route = Callable[[Request, Handler], None]
JINA_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking")


def _ranked(services: Services, req: Request) -> tuple[RerankRequest, list[str], Ranking]:
    wire = parse(RerankRequest, req.json())
    view = services.models.view(require_model(wire.model))
    texts = wire.texts()
    ranking = rerank(services, view, wire.query, texts, wire.top_n,
                     keep_alive_of(wire.keep_alive), on_disconnect=req.on_disconnect)
    return wire, texts, ranking


def results(ranking: Ranking, texts: list[str], with_documents: bool) -> list[RerankResult]:
    out: list[RerankResult] = []
    for index, score in ranking.order:
        result: RerankResult = {"index": index, "relevance_score": score}
        if with_documents:
            result["document"] = {"text": texts[index]}
        out.append(result)
    return out


def jina_rerank(services: Services) -> Route:
    def route(req: Request, handler: Handler) -> None:
        wire, texts, ranking = _ranked(services, req)
        n = ranking.prompt_tokens
        body: JinaRerank = {"model": str(wire.model), "object": "list",
                            "usage": {"prompt_tokens": n, "total_tokens": n},
                            "results": results(ranking, texts, wire.return_documents)}
        handler.send_json(200, body)
    return route


def cohere_rerank(services: Services) -> Route:
    def route(req: Request, handler: Handler) -> None:
        wire, texts, ranking = _ranked(services, req)
        body: CohereRerank = {
            "id": str(uuid.uuid4()),
            "results": results(ranking, texts, wire.return_documents),
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": ranking.prompt_tokens}}}
        handler.send_json(200, body)
    return route
