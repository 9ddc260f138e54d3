"""OpenAI's routes that generate nothing: /v1/embeddings and /v1/models."""

from __future__ import annotations

import base64
import struct
from typing import Any, Callable

from corral.api.wire import parse
from corral.api.wire.openai import EmbeddingRequest
from corral.errors import CorralError, ModelNotFound
from corral.server.http import Handler, Request
from corral.server.pipeline.embed import embed as embed_inputs
from corral.server.pipeline.services import Services


def embeddings(services: Services) -> Callable[[Request, Handler], None]:
    def route(req: Request, handler: Handler) -> None:
        wire = parse(EmbeddingRequest, req.json())
        view = services.models.view(wire.model)
        inputs = [wire.input] if isinstance(wire.input, str) else wire.input
        # `dimensions` truncates each vector before it is normalised, as /api/embed does
        # and as OpenAI's Matryoshka-trained models expect.
        result, _ = embed_inputs(services, view, [i or " " for i in inputs], None, None,
                                 wire.truncate, normalize=True, dimensions=wire.dimensions or 0,
                                 on_disconnect=req.on_disconnect)
        data = []
        for i, vector in enumerate(result.embeddings):
            value: Any = vector
            if wire.encoding_format.lower() == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "embedding": value, "index": i})
        n = result.prompt_eval_count
        handler.send_json(200, {"object": "list", "data": data, "model": wire.model,
                                "usage": {"prompt_tokens": n, "total_tokens": n}})
    return route


def _model_object(entry: Any, shown: str | None = None) -> dict[str, Any]:
    return {"id": shown or entry.name.display(), "object": "model",
            "created": int(entry.modified_at), "owned_by": entry.name.namespace}


def models(services: Services) -> Callable[[Request, Handler], None]:
    def route(req: Request, handler: Handler) -> None:
        entries = sorted(services.store.list_models(), key=lambda e: -e.modified_at)
        handler.send_json(200, {"object": "list", "data": [_model_object(e) for e in entries]})
    return route


def model(services: Services) -> Callable[[Request, Handler], None]:
    def route(req: Request, handler: Handler) -> None:
        name = req.path[len("/v1/models/"):]
        try:
            entry = services.store.entry(name)
        except CorralError:
            raise ModelNotFound(f"model '{name}' not found") from None
        handler.send_json(200, _model_object(entry, name))
    return route
