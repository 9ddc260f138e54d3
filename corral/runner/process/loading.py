"""The model load, started before the runner's heavier modules are imported.

llama.cpp reads the weights and zeroes the KV cache in C, with the GIL
released, for a few tenths of a second. `begin` starts that on a helper
thread, so the Python imports of the engine, sampling (numpy), templates
(jinja2) and the HTTP service run at the same time instead of before it. The
context is handed over whole to the engine thread, which alone uses it after.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corral.process import limit_malloc_arenas
from corral.errors import BadRequest, CorralError, RunnerError
from corral.registry.gguf import GGUFInfo, inspect_gguf
from corral.runner import fitestimate
from corral.runner.llama import mtpcontext, native
from corral.runner.tools import rpc
from corral.runner.llama.context import EngineConfig, LlamaContext
from corral.runner.kv.reserve import possible as reserve_possible
from corral.runner.loadconfig import LoadConfig
from corral.runner.speculative.draftmodel import STREAMS

log = logging.getLogger("corral.runner")

if TYPE_CHECKING:
    from corral.runner.llama.vision import Vision
    from corral.runner.speculative.mtp import MtpHead
    from corral.runner.speculative.source import DraftSource


@dataclass
class LoadedModel:
    """What loading gave the runner process: the weights' context and what was measured."""

    config: LoadConfig
    info: GGUFInfo
    estimate: fitestimate.Estimate
    engine_config: EngineConfig
    llama: LlamaContext
    seconds: float
    rpc_bytes: int = 0  # of the estimate, what lives on RPC workers
    vision: "Vision | None" = None
    draft: "DraftSource | None" = None  # a DRAFT model, or the model's own MTP head
    draft_bytes: int = 0  # of the estimate's weights, a draft model's and its KV (0: none)
    draft_error: str = ""  # why the model's draft model did not load ("": it did, or none)


def layout(config: LoadConfig, offloaded: bool, pages_follow: bool) -> int:
    """The shared KV buffer's size (0: a KV stream per slot). The daemon's default, a
    buffer of every slot's num_ctx (`kv_shared`), costs only the pages its cells write
    where the KV is host memory and ggml hands a clear's pages back (`pages_follow`:
    install.sh's ggml); elsewhere (a GPU's memory, stock ggml) it would commit the whole
    buffer at load, so a stream per slot holds what is used instead (elastic, unless
    the slot count is fixed). A pool asked for (CORRAL_KV_POOL=on) is kept as asked."""
    if config.kv_shared and (offloaded or not pages_follow):
        return 0
    return config.kv_pool


def load(config: LoadConfig) -> LoadedModel:
    info = inspect_gguf(config.model)  # reject malformed files before llama.cpp sees them
    if config.n_slots < 1 or config.n_slots > 256:
        raise BadRequest("slots must be between 1 and 256")
    # A pool is one buffer of kv_pool tokens whatever the slot count.
    per_slot = -(-config.kv_pool // config.n_slots) if config.kv_pool else config.num_ctx
    gpu_free = fitestimate.free_gpu_memory()  # before RPC devices join the GPU-type list
    # Remote workers' devices count as offload targets beside local GPUs; llama.cpp
    # splits the offloaded layers between all of them by the free memory each reports.
    rpc_free = sum(w.free for w in rpc.add_workers(config.rpc_servers))
    draft_bytes, draft_error = _draft_size(config, per_slot)
    draft_cells = per_slot * min(config.n_slots, STREAMS)
    head_bytes = 0 if not config.speculative or config.draft else \
        fitestimate.head_kv_bytes(info, per_slot, config.n_slots, config.kv_cache_type)
    adapters = _beside(config) + draft_bytes + head_bytes
    # With nowhere to offload to, llama.cpp keeps every layer on the CPU whatever num_gpu
    # asks; the estimate (and so `ps`) must say so too.
    num_gpu = config.num_gpu if fitestimate.gpu_backend_present() or rpc_free else 0
    est = fitestimate.estimate(info, per_slot, config.n_slots, gpu_free + rpc_free,
                          num_gpu, config.kv_cache_type, config.n_batch, adapters=adapters,
                          window_cache=not config.deterministic,
                          speculative=config.speculative)
    rpc_bytes = est.gpu_bytes * rpc_free // max(gpu_free + rpc_free, 1)
    cfg = EngineConfig(
        n_slots=config.n_slots, num_ctx=config.num_ctx, n_batch=config.n_batch,
        n_threads=config.n_threads, n_gpu_layers=est.gpu_layers, flash_attn=config.flash_attn,
        kv_cache_type=config.kv_cache_type, use_mmap=config.use_mmap,
        kv_pool=layout(config, est.gpu_layers > 0 or bool(rpc_free), reserve_possible()),
        deterministic=config.deterministic, speculative=config.speculative,
        adapters=config.adapters,
        start_slots=config.start_slots, cache_ram=config.cache_ram,
        cache_disk=config.cache_disk, cache_dir=config.cache_dir,
        projector=config.projector or "")
    native.init_backend(deterministic=cfg.deterministic)
    t0 = time.perf_counter()
    llama = LlamaContext(config.model, cfg)
    vision = _vision(config, llama, est.gpu_layers > 0) if config.projector else None
    draft: "DraftSource | None"
    try:
        draft, why = _with_draft(config, llama, est, draft_cells) if draft_bytes else (None, "")
        draft_error = draft_error or why
    except BaseException:
        llama.free()
        if vision is not None:
            vision.close()
        raise
    held = draft_bytes if draft is not None else 0
    if draft is None and llama.has_head and llama.can_rollback:  # a DRAFT goes first
        draft = mtp_head(llama, config.draft_num_predict)
    if draft is None and draft_bytes + head_bytes:  # estimated, and not held after all
        est = est.without(draft_bytes + head_bytes)
        rpc_bytes = est.gpu_bytes * rpc_free // max(gpu_free + rpc_free, 1)
    return LoadedModel(config, info, est, cfg, llama, time.perf_counter() - t0, rpc_bytes,
                       vision, draft, held, draft_error)


def _beside(config: LoadConfig) -> int:
    """Adapters and a projector are weights beside the model's (the projector's compute
    buffers are small next to its weights for the models this serves)."""
    adapters = sum(os.path.getsize(path) for path, _ in config.adapters)
    return adapters + (os.path.getsize(config.projector) if config.projector else 0)


def _vision(config: LoadConfig, llama: LlamaContext, use_gpu: bool) -> "Vision":
    """The projector, beside the loaded model (which goes if the projector fails)."""
    from corral.runner.llama.vision import Vision  # numpy: not before the load has started

    assert config.projector is not None
    try:
        return Vision(config.projector, llama.model, llama.n_threads, use_gpu=use_gpu,
                      num_ctx=llama.num_ctx)
    except BaseException:
        llama.free()
        raise


def _draft_size(config: LoadConfig, per_slot: int) -> tuple[int, str]:
    """What the draft model will hold, its weights and KV (0: none loads), or why it
    cannot load (a pulled DRAFT layer that is no GGUF, say)."""
    if config.draft is None or not config.speculative:
        return 0, ""
    try:
        return fitestimate.draft_bytes(inspect_gguf(config.draft), os.path.getsize(config.draft),
                                       per_slot, config.n_slots, config.kv_cache_type), ""
    except (CorralError, OSError) as exc:
        return 0, _without_draft(exc)


def _without_draft(exc: CorralError | OSError) -> str:
    """A draft model can only help: one that does not load leaves the model loaded without
    it, saying why (the log, and `ps`)."""
    message = exc.message if isinstance(exc, CorralError) else str(exc)
    log.warning("the draft model did not load; the model runs without it: %s", message)
    return message


def _with_draft(config: LoadConfig, llama: LlamaContext, est: fitestimate.Estimate,
                cells: int) -> "tuple[DraftSource | None, str]":
    """The draft model, or None and why not ("": the model cannot verify drafts)."""
    if not llama.can_rollback:
        return None, ""
    try:
        return _load_draft(config, llama, est, cells), ""
    except CorralError as exc:  # an architecture llama.cpp cannot run, no memory for its KV
        return None, _without_draft(exc)


def _load_draft(config: LoadConfig, llama: LlamaContext, est: fitestimate.Estimate,
                cells: int) -> "DraftSource":
    """The draft model, or an MTP sidecar's head: on the GPU where the whole model is,
    else beside it on the CPU. RunnerError where its memory cannot cut back a rejected
    proposal (recurrent, hybrid), or a sidecar's head cannot read the model."""
    from corral.runner.llama.draftcontext import DraftContext
    from corral.runner.speculative.draftmodel import DraftModel

    assert config.draft is not None
    gpu_layers = -1 if est.gpu_layers >= est.layers > 0 else 0
    if fitestimate.is_mtp_sidecar(inspect_gguf(config.draft)):
        if not mtpcontext.available():
            raise RunnerError("this llama.cpp does not hand out the hidden states an MTP "
                              "head reads")
        return _sidecar(config, llama, gpu_layers)
    context = DraftContext(config.draft, config.n_slots, cells, llama.n_threads,
                           gpu_layers, llama.kv_type, llama.flash_attn_type)
    if not context.can_rollback:
        context.free()
        raise RunnerError("the draft model's memory is recurrent: it cannot drop a rejected "
                          "proposal")
    return DraftModel(context, llama.n_vocab, cells, config.draft_num_predict,
                      context.n_vocab)


def mtp_head(llama: LlamaContext, n_max: int = 0) -> "MtpHead | None":
    """The model's own MTP head as its draft source (`n_max`: the most tokens a draft,
    0 for llama-server's), or None where its context cannot be made (an architecture
    whose head llama.cpp runs some other way: the model runs without)."""
    try:
        return _head(llama, llama.model, n_max)
    except RunnerError as exc:
        log.warning("the model's MTP head is not used: %s", exc)
        return None


def _head(llama: LlamaContext, model: Any, n_max: int, owned: bool = False) -> "MtpHead":
    """An MTP head on `model` (the model's own, or a sidecar's it then `owned`) for
    `llama`'s slots, reading `llama`'s hidden states, which its contexts keep from now."""
    from corral.runner.llama.mtpcontext import MtpContext, hidden_states
    from corral.runner.speculative.mtp import MtpHead

    slots = llama.cfg.n_slots
    # its sequence ids are the model's: the slots' and the scratch sequence
    head = MtpContext(model, slots + 1, llama.num_ctx * slots, llama.n_batch,
                      llama.n_threads, llama.kv_type, llama.flash_attn_type, owned)
    n_embd = head.n_embd
    llama.keep_hidden_states()
    return MtpHead(head, lambda n: hidden_states(llama.ctx, n, n_embd), n_max)


def _sidecar(config: LoadConfig, llama: LlamaContext, gpu_layers: int) -> "MtpHead":
    """A DRAFT that is an MTP sidecar: its head drafts from the model's hidden states.
    RunnerError where it does not load or its width is not the model's."""
    import llama_cpp as L

    assert config.draft is not None
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers, mparams.load_mtp = gpu_layers, True
    model = L.llama_model_load_from_file(config.draft.encode(), mparams)
    if not model:
        raise RunnerError(f"llama.cpp could not load the MTP head {config.draft}")
    if L.llama_model_n_embd_out(model) != L.llama_model_n_embd_out(llama.model) or \
            L.llama_model_n_layer_nextn(model) != 1:
        L.llama_model_free(model)
        raise RunnerError("the MTP head is not one head of the model's width")
    return _head(llama, model, config.draft_num_predict, owned=True)


class Pending:
    """A load running on its helper thread; `result()` waits for it."""

    def __init__(self, argv: list[str]) -> None:
        parser = argparse.ArgumentParser(prog="python -m corral.runner")
        parser.add_argument("--config", required=True, help="JSON load configuration")
        parser.add_argument("--verbose", action="store_true")
        self.args = parser.parse_args(argv)
        limit_malloc_arenas()  # before any thread allocates
        self._loaded: LoadedModel | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loaded = load(LoadConfig.from_json(self.args.config))
        except BaseException as exc:  # re-raised on the main thread by result()
            self._error = exc

    def result(self) -> LoadedModel:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._loaded is not None
        return self._loaded

