"""The model's tokenizer over HTTP: Ollama's proposed /api/tokenize and /api/detokenize
(its unmerged pull request's shape) and llama-server's /tokenize and /detokenize.

Both run llama.cpp's own tokenizer in the model's runner (runner/process/service.py), so the ids
are llama-server's on the same GGUF. llama-server serves one model and Corral many: its
routes take a `model` too, and without one mean the only loaded model (a 400 asks for a
name when none or several are loaded). An unknown model is a 404: Ollama's shape on
/api/*, llama-server's (OpenAI's) on /tokenize and /detokenize (server/asgi.shape_of).
"""

from __future__ import annotations

from typing import Callable

from corral.api.wire import parse
from corral.api.wire.tokens import (DetokenizeRequest, LlamaDetokenizeRequest,
                                    LlamaTokenizeRequest, TokenizeRequest)
from corral.runner.wire import Tokenize
from corral.server.http import Handler, Request
from corral.server.chat.models import require_model
from corral.server.pipeline.count import detokenize, only_loaded, tokenize
from corral.server.pipeline.services import Services, keep_alive_of

Route = Callable[[Request, Handler], None]


def api_tokenize(services: Services) -> Route:
    """{model, content} -> {tokens}: the text as it stands (no BOS), control tokens'
    text read as those tokens, as llama-server's defaults."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(TokenizeRequest, req.json())
        tokens = tokenize(services, require_model(wire.model), Tokenize(wire.content),
                          keep_alive_of(wire.keep_alive))
        handler.send_json(200, {"tokens": tokens})
    return route


def api_detokenize(services: Services) -> Route:
    """{model, tokens} -> {content}: each token's text, control tokens' included."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(DetokenizeRequest, req.json())
        content = detokenize(services, require_model(wire.model), wire.tokens,
                             keep_alive_of(wire.keep_alive))
        handler.send_json(200, {"content": content})
    return route


def llama_tokenize(services: Services) -> Route:
    """llama-server's: `add_special`, `parse_special`, `with_pieces` ({id, piece}, the
    piece a string or, where it is not valid UTF-8 alone, its bytes)."""
    def route(req: Request, handler: Handler) -> None:
        wire = parse(LlamaTokenizeRequest, req.json())
        model = wire.model or only_loaded(services)
        if wire.content is None:
            services.models.view(model)  # a wrong name is still a 404
            handler.send_json(200, {"tokens": []})
            return
        command = Tokenize(wire.content, wire.add_special, wire.parse_special,
                           wire.with_pieces)
        handler.send_json(200, {"tokens": tokenize(services, model, command)})
    return route


def llama_detokenize(services: Services) -> Route:
    def route(req: Request, handler: Handler) -> None:
        wire = parse(LlamaDetokenizeRequest, req.json())
        model = wire.model or only_loaded(services)
        handler.send_json(200, {"content": detokenize(services, model, wire.tokens)})
    return route
