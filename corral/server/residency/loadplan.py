"""What a resident model is loaded with: its record, its options and slots, and the
daemon's settings, as the one LoadConfig the runner process is started with."""

from __future__ import annotations

from corral.config import Settings, state_dir
from corral.runner.loadconfig import LoadConfig
from corral.server.residency.fit import MemoryFit
from corral.server.residency.resident import Resident


def load_config(entry: Resident, settings: Settings, fit: MemoryFit) -> LoadConfig:
    record = entry.record
    return LoadConfig.from_options(
        str(record.model_path), entry.options, n_slots=entry.slots,
        flash_attn=settings.flash_attention,
        kv_cache_type=settings.kv_cache_type, template=record.template,
        kv_pool=fit.pool_tokens(record, entry.options, entry.slots),
        kv_shared=settings.shared_kv,
        # Per-slot streams are elastic: one slot's KV while idle, growing to the memory
        # fit as requests run at once; CORRAL_NUM_PARALLEL=N holds N from the start. The
        # shared buffer passes it on too: where its pages cannot follow use, the runner
        # falls back to those streams (runner.process.loading.layout).
        start_slots=1 if settings.num_parallel <= 0 and not settings.kv_pool else 0,
        deterministic=settings.deterministic, speculative=settings.speculative,
        adapters=tuple((str(path), 1.0) for path in record.adapters),
        projector=str(record.projector) if record.projector else None,
        draft=str(record.draft) if record.draft else None,
        cache_ram=fit.cache_ram(), cache_disk=settings.cache_disk,
        cache_dir=str(state_dir() / "kvcache"), step_timeout=settings.step_timeout,
        max_body=settings.max_body,
        rpc_servers=LoadConfig.rpc_from(entry.options, settings.rpc_servers))
