"""Routes that make models and move them: create, pull and push, each a progress stream.

A stream starts with its first progress event, so an error found before any work (a
bad name, a missing source) is still a plain 4xx; an error after that is the stream's
last line, as Ollama sends it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from corral.api.types import STREAM_CONTENT_TYPE
from corral.api.wire import manage as wire
from corral.api.wire import parse
from corral.errors import BadRequest, CorralError, format_error
from corral.registry.create import CreateRequest, create_model
from corral.registry.derive import Quantizer, file_type
from corral.registry.modelfile import parse_modelfile
from corral.registry.names import parse_name
from corral.registry.pull import Puller
from corral.registry.push import Pusher
from corral.runner.tools.quantize import quantize_in_child
from corral.runner.tools.probe import probe_in_child
from corral.server.http import Handler, Request, StreamWriter
from corral.server.chat.models import require_model
from corral.server.pipeline.services import Services

Work = Callable[[Callable[[dict[str, Any]], None], Callable[[], bool]], Any]


def stream_progress(stream: bool, handler: Handler, work: Work) -> None:
    """Run `work(progress, cancelled)`, streaming its events live unless `stream` is false."""
    if not stream:
        work(lambda event: None, lambda: False)
        handler.send_json(200, {"status": "success"})
        return
    writer: StreamWriter | None = None

    def progress(event: dict[str, Any]) -> None:
        nonlocal writer
        if writer is None:
            writer = handler.start_stream(STREAM_CONTENT_TYPE)
        writer.write(json.dumps(event).encode() + b"\n")

    try:
        work(progress, lambda: writer is not None and writer.closed)
    except CorralError as exc:
        if writer is None:
            raise
        writer.write(json.dumps(format_error(exc)[1]).encode() + b"\n")
    if writer is not None:
        writer.end()


def pull(services: Services, puller: Puller) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.TransferRequest, req.json())
        name = require_model(body.target)
        parse_name(name)  # a bad name is a 400 now, not a 200 stream with an error line
        stream_progress(body.streams, handler, lambda progress, cancelled: puller.pull(
            name, progress, body.insecure, cancelled=cancelled))
    return route


def push(services: Services, pusher: Pusher) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.TransferRequest, req.json())
        name = require_model(body.target)
        services.store.require(parse_name(name))  # a 404 before the stream starts
        stream_progress(body.streams, handler, lambda progress, cancelled: pusher.push(
            name, progress, body.insecure, cancelled=cancelled))
    return route


def _create_request(body: wire.CreateRequest) -> CreateRequest:
    model = body.target
    if not model:
        raise BadRequest("invalid model name")
    req = CreateRequest(model=model)
    if body.modelfile:
        mf = parse_modelfile(body.modelfile)
        # Remote clients never name server paths: only models or uploaded blobs.
        if mf.from_.startswith("@"):
            req.files = {"model.gguf": mf.from_[1:]}
        else:
            req.from_ = mf.from_
        for i, ref in enumerate(mf.projectors):
            if not ref.startswith("@"):
                raise BadRequest("a second FROM must name an uploaded blob (@sha256:...) here")
            req.files[f"projector{i}.gguf"] = ref[1:]
        for i, ref in enumerate(mf.adapters):
            if not ref.startswith("@"):
                raise BadRequest("ADAPTER must name an uploaded blob (@sha256:...) here")
            req.adapters[f"adapter{i}.gguf"] = ref[1:]
        if mf.draft and mf.draft.startswith("@"):
            req.draft_files = {"draft.gguf": mf.draft[1:]}
        else:
            req.draft = mf.draft
        req.template, req.system = mf.template, mf.system
        req.license, req.parameters, req.messages = mf.licenses, mf.parameters, mf.messages
    else:
        req.from_ = body.from_ or None
        req.files = dict(body.files or {})
        req.adapters = dict(body.adapters or {})
        req.draft, req.draft_files = body.draft or None, dict(body.draft_files or {})
        req.template, req.system = body.template, body.system
        lic = body.license or []
        req.license = [lic] if isinstance(lic, str) else list(lic)
        req.parameters = dict(body.parameters or {})
        req.messages = body.messages
    quantize = body.quantize or body.quantization
    if quantize:
        file_type(quantize)  # an unknown type is a 400 before any work
        req.quantize = quantize
        req.requantize = body.requantize
    return req


def _quantizer(cancelled: Callable[[], bool]) -> Quantizer:
    def run(src: Path, dst: Path, type_name: str, requantize: bool,
            progress: Callable[[int, int, str], None]) -> None:
        quantize_in_child(src, dst, type_name, requantize, progress, cancelled)
    return run


def create(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.CreateRequest, req.json())
        request = _create_request(body)
        limit = services.settings.max_create_files
        if len(request.files) > limit:
            raise BadRequest(f"too many files: {len(request.files)} is over the limit of {limit}"
                             " (CORRAL_MAX_CREATE_FILES)")
        if request.template is not None:
            from corral.server.chat.templates.gotemplate import GoTemplate
            GoTemplate(request.template)  # a broken template is a 400 now, not a bad prompt later
        stream_progress(body.streams, handler, lambda progress, cancelled: create_model(
            services.store, request, progress, quantizer=_quantizer(cancelled),
            load_projector=probe_in_child))
    return route
