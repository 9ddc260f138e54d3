"""One LoadConfig from the scheduler to the engine: built from options, carried as JSON."""

from __future__ import annotations

import pytest

from corral.errors import BadRequest
from corral.options import LOAD_OPTIONS, Options
from corral.runner.loadconfig import DEFAULT_BATCH, LoadConfig


def test_from_options_maps_ollama_names() -> None:
    cfg = LoadConfig.from_options("/m.gguf", Options(num_ctx=2048, num_batch=256, num_thread=3,
                                                     num_gpu=7, main_gpu=1, use_mmap=False),
                                  n_slots=4, flash_attn=True, kv_cache_type="q8_0",
                                  template="{{ .Prompt }}")
    assert (cfg.num_ctx, cfg.n_batch, cfg.n_threads, cfg.num_gpu, cfg.main_gpu) == (2048, 256, 3,
                                                                                     7, 1)
    assert not cfg.use_mmap and cfg.n_slots == 4 and cfg.kv_cache_type == "q8_0"
    assert LoadConfig.from_json(cfg.to_json()) == cfg


def test_the_speculative_switch_travels_to_the_runner() -> None:
    assert LoadConfig.from_options("/m.gguf", Options()).speculative  # on unless told
    off = LoadConfig.from_options("/m.gguf", Options(), speculative=False)
    assert LoadConfig.from_json(off.to_json()).speculative is False


def test_defaults_and_the_load_option_table_agree() -> None:
    cfg = LoadConfig.from_options("/m.gguf", Options())
    assert cfg.n_batch == DEFAULT_BATCH and cfg.num_gpu == -1 and cfg.use_mmap
    assert {"num_ctx", "num_batch", "num_gpu", "num_thread", "use_mmap", "main_gpu"} <= LOAD_OPTIONS


@pytest.mark.parametrize("text", ["not json", "[]", '{"n_slots": 2}', '{"model": "m", "x": 1}'])
def test_a_bad_configuration_is_refused(text: str) -> None:
    with pytest.raises(BadRequest):
        LoadConfig.from_json(text)
