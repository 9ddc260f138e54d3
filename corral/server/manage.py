"""Model management routes: tags, show, create, blobs, copy, delete, ps, version."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from corral.api.types import rfc3339
from corral.api.wire import manage as wire
from corral.api.wire import parse
from corral.config import FOREVER
from corral.errors import (
    BadRequest,
    CorralError,
    ModelNotFound,
    NotFound,
)
from corral.version import corral_version
from corral.registry.gguf import GGUFInfo, human_parameter_count
from corral.registry.modelfile import format_modelfile
from corral.registry.ggufdump import dump_gguf
from corral.registry.models import ModelRecord, details, load_record, read_config
from corral.registry.store import ModelEntry
from corral.registry.names import Name, parse_name
from corral.registry.projector import projector_info
from corral.runner.wire import Health, LoadReport
from corral.server.http import Handler, Request
from corral.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from corral.server.chat.models import ModelView, require_model
from corral.server.residency.resident import Resident
from corral.server.residency.scheduler import Scheduler
from corral.server.pipeline.services import Services

API_VERSION = "0.33.0-rc2"  # the pinned Ollama source (tests/peers/ollama/VERSION); clients gate on it
FOREVER_SECONDS = 292 * 365 * 86400


def _describe(services: Services, name: Name) -> tuple[ModelView, dict[str, Any]]:
    """A model's view and its `details` (with the header's lengths)."""
    view = services.models.view_by_name(name)
    try:
        info: GGUFInfo | None = services.store.gguf_info(view.record.model_digest)
    except CorralError:
        info = None
    return view, view.record.details(info)


def _model_entry(services: Services, entry: ModelEntry) -> dict[str, Any]:
    name = entry.name.display()
    out = {"name": name, "model": name, "modified_at": rfc3339(entry.modified_at, utc=False),
           "size": entry.size, "digest": entry.digest}
    try:
        view, out["details"] = _describe(services, entry.name)
        out["capabilities"] = list(view.capabilities)
    except CorralError:  # a model whose weights are gone still lists, as in Ollama
        out["details"] = details(read_config(services.store, entry))
    return out


def tags(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        entries = sorted(services.store.list_models(), key=lambda e: -e.modified_at)
        handler.send_json(200, {"models": [_model_entry(services, e) for e in entries]})
    return route


def _param_lines(params: dict[str, Any]) -> str:
    lines = []
    for key, value in params.items():
        for item in value if isinstance(value, list) else [value]:
            shown = json.dumps(item) if isinstance(item, str) else str(item).lower() \
                if isinstance(item, bool) else str(item)
            lines.append(f"{key:<30} {shown}")
    return "\n".join(lines)


def _model_info(info: GGUFInfo, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in (metadata or info.metadata).items()
                           if k not in ("general.name", "tokenizer.chat_template")}
    out["general.parameter_count"] = info.parameter_count
    return out


def draft_info(services: Services, record: ModelRecord) -> dict[str, Any]:
    """The draft model (a Modelfile's DRAFT): where it came from, and its `details`."""
    assert record.draft_digest is not None
    try:
        info: GGUFInfo | None = services.store.gguf_info(record.draft_digest)
    except CorralError:
        info = None
    out: dict[str, Any] = {"model": record.draft_from or "", "digest": record.draft_digest}
    if info is not None:  # its blob is there
        out["size"] = info.file_size
        out["details"] = {"family": info.architecture,
                          "parameter_size": human_parameter_count(info.parameter_count),
                          "quantization_level": info.quantization}
    return out


def _draft_error(services: Services, record: ModelRecord) -> dict[str, str]:
    """Where the model is loaded and its draft model did not load with it: why."""
    for entry in services.scheduler.running():
        if entry.record.digest == record.digest and entry.runner is not None \
                and entry.runner.report.draft_error:
            return {"error": entry.runner.report.draft_error}
    return {}


def show(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.ShowRequest, req.json())
        parsed = parse_name(require_model(body.target))
        stored = services.store.resolve(parsed)
        if stored is None:
            raise ModelNotFound(f"model '{parsed.display()}' not found")
        view, model_details = _describe(services, stored)
        record, template, caps = view.record, view.template, list(view.capabilities)
        params = {**record.parameters, **(body.options or {})}
        system = body.system or record.system
        header = ('# Modelfile generated by "corral show"\n'
                  "# To build a new Modelfile based on this, replace FROM with:\n"
                  f"# FROM {record.name.display()}\n\n")
        froms = [str(record.model_path)] + ([str(record.projector)] if record.projector else [])
        modelfile = header + format_modelfile(froms, params, record.template,
                                              system, record.licenses, record.messages,
                                              tuple(str(path) for path in record.adapters),
                                              str(record.draft) if record.draft else None)
        out: dict[str, Any] = {
            "modelfile": modelfile, "parameters": _param_lines(params), "template": template,
            "details": model_details, "capabilities": caps,
            "modified_at": rfc3339(record.modified_at, utc=False),
        }
        info = services.store.gguf_info(record.model_digest)
        if body.verbose:
            metadata, out["tensors"] = dump_gguf(record.model_path)
            out["model_info"] = _model_info(info, metadata)
        else:
            out["model_info"] = _model_info(info)
        if record.projector_digest is not None:
            out["projector_info"] = projector_info(services.store.gguf_info(record.projector_digest))
        if record.draft_digest is not None:  # a Corral extension, as Ollama shows none yet
            out["draft"] = draft_info(services, record) | _draft_error(services, record)
        if system:
            out["system"] = system
        if record.licenses:
            out["license"] = "\n".join(record.licenses)
        if record.messages:
            out["messages"] = record.messages
        loaded = [m for m in services.scheduler.running() if m.record.digest == record.digest]
        if loaded:
            services.scheduler.refresh()  # a Corral extension: the loaded model's prompt cache
            out["prompt_cache"] = prompt_cache(_health(loaded[0]))
        handler.send_json(200, out)
    return route


def blobs(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        digest = req.path[len("/api/blobs/"):]
        path = services.store.blob_path(digest)
        if req.method == "HEAD":
            if not path.is_file():
                raise NotFound(f'blob "{digest}" not found')
            handler.send_text(200, "")
            return
        if path.is_file():
            for _ in req.body_chunks():
                pass
            handler.send_text(200, "")
            return
        services.store.write_blob(req.body_chunks(), expected=digest)
        handler.send_text(201, "")
    return route


def copy(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.CopyRequest, req.json())
        src, dst = body.source or "", body.destination or ""
        for label, value in (("source", src), ("destination", dst)):
            try:
                parse_name(value)
            except CorralError:
                raise BadRequest(f'{label} "{value}" is invalid') from None
        if services.store.resolve(src) is None:
            raise ModelNotFound(f'model "{src}" not found')
        services.store.copy(src, parse_name(dst))
        handler.send_json(200, {})
    return route


def delete(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        body = parse(wire.DeleteRequest, req.json())
        name = require_model(body.target)
        try:
            parsed = parse_name(name)
        except CorralError:
            raise BadRequest(f'name "{name}" is invalid') from None
        if services.store.resolve(parsed) is None:
            raise ModelNotFound(f"model '{name}' not found")
        record = load_record(services.store, parsed)
        # At once, as Ollama does: the manifest and every blob nothing else uses go now
        # (a runner that has the weights mapped keeps them until it exits), and a loaded
        # model unloads as soon as its running streams finish.
        services.store.delete(parsed)
        services.scheduler.unload(record)
        handler.send_json(200, {})
    return route


def _health(entry: Resident) -> Health | None:
    """What the model's runner last said of itself (Scheduler.refresh asks it first, with a
    short deadline); None before its first answer. `ps`, `show` and /metrics never wait on
    a runner that does not answer."""
    return entry.health


def _sizes(entry: Resident, health: Health | None) -> dict[str, int]:
    """ps' memory fields. `size` is what the model holds now (LoadReport.held): the
    weights and compute buffer, the KV committed (elastic KV holds one slot's worth while
    idle and grows as requests run at once; the reserve's streams cost only the cells
    written: runner.kv.growth), the prompt cache's RAM and the n-gram index. Not the
    runner's RSS, which adds the interpreter and, on a GPU, the driver's host memory,
    and would show a fully offloaded model partly on the CPU; on a CPU the two stay
    within 20% (test_ps_size).
    `size_cap` is what the model may grow to, which fitting other models reckons with.
    Without a health answer yet: as loaded."""
    report = entry.runner.report if entry.runner is not None else LoadReport()
    kv = health.kv_bytes if health is not None else report.kv_per_slot * report.start_slots
    cache = health.cache.bytes if health is not None else 0
    # Speculative decoding's draft source (its n-gram index) is held beside the prompt
    # cache; the cap leaves it out, as the slot fit takes its bound off the budget already.
    index = health.index_bytes if health is not None else 0
    size, vram, rpc = report.held(kv, cache + index)
    out = {"size": size, "size_vram": vram, "size_cap": max(report.size + cache, size)}
    if report.size_rpc:  # a Corral extension: bytes on RPC workers
        out["size_rpc"] = rpc
    return out


def prompt_cache(health: Health | None) -> dict[str, int]:
    """A Corral extension in ps and show: what the model's prompt cache holds and did."""
    return health.cache.shown() if health is not None else {}


def _draft(entry: Resident, report: LoadReport) -> dict[str, Any]:
    """A Corral extension in ps: the draft model drafting for this one, if one does."""
    record = entry.record
    if record.draft_digest is None or not (report.draft or report.draft_error):
        return {}
    draft = {"model": record.draft_from or "", "digest": record.draft_digest,
             "size": report.draft}
    if report.draft_error:  # it did not load: the model answers from its own weights
        draft["error"] = report.draft_error
    return {"draft": draft}


def ps(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        now = time.time()
        models = []
        services.scheduler.refresh()
        for entry in services.scheduler.running():
            report = entry.runner.report if entry.runner is not None else LoadReport()
            if entry.expires_at is not None:
                expires = entry.expires_at
            elif entry.keep_alive == FOREVER:
                expires = now + FOREVER_SECONDS
            else:  # busy: the timer starts when the last request ends
                expires = now + entry.keep_alive
            name = entry.record.name.display()
            health = _health(entry)
            slots = health.slots if health is not None else report.start_slots
            models.append({"name": name, "model": name, **_sizes(entry, health),
                           "digest": entry.record.digest, "details": entry.record.details(),
                           "expires_at": rfc3339(expires, utc=False),
                           "context_length": report.num_ctx,
                           # Corral extensions: slots now and how many of them are busy
                           # (the page's live view), and what elastic KV may grow to.
                           "slots": slots,
                           "slots_busy": health.busy_slots if health is not None else 0,
                           "slots_cap": report.slots or slots,
                           "prompt_cache": prompt_cache(health),
                           **_draft(entry, report)})
        models.sort(key=lambda m: str(m["expires_at"]), reverse=True)
        handler.send_json(200, {"models": models})
    return route


def version(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        handler.send_json(200, {"version": API_VERSION, "corral": corral_version()})
    return route


def root(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        handler.send_text(200, "Corral is running")
    return route


def runner_gauges(scheduler: Scheduler) -> Iterator[tuple[str, dict[str, float]]]:
    """What each loaded runner reports, by /metrics' names (server.metrics)."""
    scheduler.refresh()
    for entry in scheduler.running():
        values: dict[str, float] = {"slots": entry.slots}
        health = _health(entry)
        if health is not None:
            cache = health.cache
            values.update({"queue_depth": health.waiting, "busy_slots": health.busy_slots,
                           "kv_cells_used": health.kv_used,
                           "kv_cells_reserved": health.kv_reserved,
                           "preemptions_total": health.preemptions,
                           "sampled_tokens_total": health.sampled,
                           "cache_bytes": cache.bytes, "cache_budget": cache.budget,
                           "cache_entries": cache.entries, "cache_hits_total": cache.hits,
                           "cache_tokens_restored_total": cache.tokens_restored,
                           "cache_tokens_shared_total": cache.tokens_shared})
            if cache.disk_bytes is not None:
                values["cache_disk_bytes"] = cache.disk_bytes
        yield entry.record.name.display(), values


def metrics(services: Services) -> Any:
    def route(req: Request, handler: Handler) -> None:
        handler.send_bytes(200, services.metrics.render(),
                           [("content-type", METRICS_CONTENT_TYPE)])
    return route
