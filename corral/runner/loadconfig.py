"""What it takes to load a model: one record from the scheduler down to the engine.

The scheduler builds it from merged options and settings, the runner client
hands it to the runner process as JSON, and the process turns it into the
engine's configuration once the offload split is known.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from corral.errors import BadRequest
from corral.options import Options

DEFAULT_BATCH = 512


@dataclass(frozen=True)
class LoadConfig:
    model: str
    n_slots: int = 1
    num_ctx: int = 4096  # per slot
    n_batch: int = DEFAULT_BATCH
    n_threads: int = 0  # 0: physical cores
    num_gpu: int = -1  # layers to offload; -1: as many as fit
    main_gpu: int = 0
    use_mmap: bool = True
    flash_attn: bool | None = None  # None: llama.cpp decides
    kv_cache_type: str = "f16"
    template: str | None = None  # a TEMPLATE layer, which wins over the GGUF's
    kv_pool: int = 0  # tokens in a KV pool the slots share; 0: one reservation per slot
    # The pool is the default layout's (every slot's num_ctx), not one asked for: where
    # its pages cannot follow the cells, the runner keeps a stream per slot instead.
    kv_shared: bool = False
    start_slots: int = 0  # elastic KV: slots held while idle, growing to n_slots; 0: fixed
    deterministic: bool = False  # batch-invariant kernels (slower; see EngineConfig)
    speculative: bool = True  # n-gram speculative decoding (CORRAL_SPECULATIVE; EngineConfig)
    adapters: tuple[tuple[str, float], ...] = ()  # LoRA GGUF paths and their scales
    rpc_servers: tuple[str, ...] = ()  # llama.cpp RPC workers, host:port
    projector: str | None = None  # a vision projector GGUF (mmproj) loaded beside the model
    draft: str | None = None  # a draft model's GGUF (a Modelfile's DRAFT), loaded beside it
    draft_num_predict: int = 0  # the most tokens it proposes at a time; 0: its default
    cache_ram: int = 0  # bytes of host RAM for the prompt cache (runner.cache.promptcache)
    cache_disk: int = 0  # bytes of disk for its tier under cache_dir (runner.cache.diskcache)
    cache_dir: str = ""
    # Seconds the engine may spend inside one step (CORRAL_STEP_TIMEOUT; runner.process.main):
    # one step is at most n_batch prompt tokens or a row per slot, which a slow laptop's
    # CPU takes minutes over only for the largest models; 0 or negative: no bound.
    step_timeout: float = 300.0
    # The daemon's largest request body (CORRAL_MAX_BODY): a job carries a request's media
    # as they came (base64) beside the text rendered from it, so the runner takes twice it.
    max_body: int = 16 << 20

    @classmethod
    def from_options(cls, model: str, options: Options, **settings: Any) -> "LoadConfig":
        """From load options (Ollama's names) plus daemon settings."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value
        return cls(model=model,
                   num_ctx=given(options.num_ctx, cls.num_ctx),
                   n_batch=given(options.num_batch, DEFAULT_BATCH),
                   n_threads=given(options.num_thread, 0),
                   num_gpu=given(options.num_gpu, -1),
                   main_gpu=given(options.main_gpu, 0),
                   use_mmap=given(options.use_mmap, True),
                   draft_num_predict=given(options.draft_num_predict, 0),
                   **settings)

    @staticmethod
    def rpc_from(options: Options, default: tuple[str, ...]) -> tuple[str, ...]:
        """A request's or Modelfile's `rpc_servers` (possibly "" for none), else the setting."""
        if options.rpc_servers is None:
            return default
        return tuple(e for e in options.rpc_servers.split(",") if e)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LoadConfig":
        try:
            data = json.loads(text)
        except ValueError:
            raise BadRequest("load configuration is not JSON") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or "model" not in data or not set(data) <= names:
            raise BadRequest("load configuration has unknown or missing fields")
        if "rpc_servers" in data:
            data["rpc_servers"] = tuple(str(e) for e in data["rpc_servers"])
        if "adapters" in data:
            try:
                data["adapters"] = tuple((str(path), float(scale))
                                         for path, scale in data["adapters"])
            except (TypeError, ValueError):
                raise BadRequest("load configuration has a malformed adapter list") from None
        return cls(**data)
