"""Auto mode sizes slots by the memory estimate (level 1: the estimator and the scheduler's
policy, with a synthetic model and fake memory, no llama.cpp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.config import load_settings
from corral.options import Options
from corral.registry.gguf import GGUFInfo
from corral.registry.models import ModelRecord
from corral.registry.names import parse_name
from corral.runner import fitestimate
from corral.server.residency.scheduler import Scheduler
from tests.test_scheduler import FakeRunner

MB = 1 << 20
# 30 layers of 3 MB and a KV of 30 x 2 x 3 x 64 x 2 bytes = 23,040 bytes per token:
# 4096 tokens per slot come to 90 MiB.
INFO = GGUFInfo(3, "llama", 135_000_000, 15, "Q4_1", 8192, 30, 576, 9, 3, 64, 64, None, None,
                {**{f"blk.{i}.w": 3 * MB for i in range(30)}, "token_embd": 28 * MB}, 0, 0)
SLOT = fitestimate.kv_bytes_per_token(INFO) * 4096


def fits(n: int, budget: int) -> bool:
    room = budget - fitestimate.memory_margin(budget)
    return fitestimate.estimate(INFO, 4096, n, 0).total <= room


def test_estimator_sizes_slots_by_memory_and_never_past_the_cap() -> None:
    assert SLOT == 90 * MB
    for budget in (600 * MB, 1200 * MB, 2 << 30, 8 << 30):
        n = fitestimate.slots_that_fit(INFO, 4096, budget, 16)
        assert 1 <= n <= 16
        assert n == 16 or not fits(n + 1, budget)  # the most that fit ...
        assert n == 1 or fits(n, budget)  # ... and they do fit, margin kept
    assert fitestimate.slots_that_fit(INFO, 4096, 64 << 30, 16) == 16
    assert fitestimate.slots_that_fit(INFO, 4096, 64 << 30, 40) == 40
    assert fitestimate.slots_that_fit(INFO, 4096, 100 * MB, 16) == 1  # at least one
    assert fitestimate.slots_that_fit(INFO, 2048, 1200 * MB, 16) > fitestimate.slots_that_fit(
        INFO, 4096, 1200 * MB, 16)


def test_pool_tokens_fit_memory() -> None:
    per_token = fitestimate.kv_bytes_per_token(INFO)
    assert fitestimate.pool_tokens_that_fit(INFO, 65536, 64 << 30, 16) == 65536
    small = fitestimate.pool_tokens_that_fit(INFO, 65536, 1 << 30, 16)
    assert 256 <= small < 65536
    fixed = fitestimate.estimate(INFO, 0, 16, 0).total
    assert fixed + small * per_token <= (1 << 30) - fitestimate.memory_margin(1 << 30)


def scheduler(free: int, **env: str) -> Scheduler:
    settings = load_settings({f"CORRAL_{k}": v for k, v in env.items()})
    return Scheduler(settings, FakeRunner, free_memory=lambda: free, free_vram=lambda: 0,
                     total_memory=lambda: 64 << 30, inspect=lambda r: INFO)


def rec(tmp_path: Path) -> ModelRecord:
    return ModelRecord(parse_name("m"), "m" * 8, 1, 0.0, tmp_path / "m.gguf", "sha256:" + "0" * 64)


def test_scheduler_policy(tmp_path: Path) -> None:
    opts = Options(num_ctx=4096)
    r = rec(tmp_path)
    big, small = 64 << 30, 1200 * MB
    assert scheduler(big).fit.slots(r, opts) == fitestimate.CPU_MAX_SLOTS == 16
    # The prompt cache's RAM (a quarter of what is free, at most) counts in the fit.
    cache = fitestimate.prompt_cache_budget(None, 64 << 30, small)
    assert cache == small // 4
    # So does the n-gram index of speculative decoding, at its bound, where it is on.
    index = fitestimate.NGRAM_INDEX_BYTES
    assert scheduler(small).fit.slots(r, opts) == fitestimate.slots_that_fit(
        INFO, 4096, small - cache - index, 16)
    assert scheduler(small, CACHE_RAM="0").fit.slots(r, opts) == fitestimate.slots_that_fit(
        INFO, 4096, small - index, 16)
    assert scheduler(small, CACHE_RAM="0", SPECULATIVE="off").fit.slots(r, opts) == \
        fitestimate.slots_that_fit(INFO, 4096, small, 16)
    assert scheduler(small).fit.slots(r, opts) < 16
    assert scheduler(big, MAX_SLOTS="6").fit.slots(r, opts) == 6
    assert scheduler(big, NUM_PARALLEL="3").fit.slots(r, opts) == 3  # fixed means fixed
    assert scheduler(100 * MB, NUM_PARALLEL="8").fit.slots(r, opts) == 8
    # Pool mode: every slot a sequence; the pool, not num_ctx x slots, is what fits.
    pool = scheduler(big, KV_POOL="1")
    assert pool.fit.slots(r, opts) == 16
    assert pool.fit.pool_tokens(r, opts, 16) == 16 * 4096
    assert scheduler(big, KV_POOL="1", KV_POOL_TOKENS="4096").fit.pool_tokens(r, opts, 16) == 4096
    assert scheduler(small, KV_POOL="1").fit.pool_tokens(r, opts, 16) < 16 * 4096
    # The default: one buffer of every slot's num_ctx, for as many slots as fit, so an
    # admitted sequence has its whole context and none is preempted.
    assert scheduler(big).fit.pool_tokens(r, opts, 16) == 16 * 4096
    assert scheduler(small).fit.pool_tokens(r, opts, 3) == 3 * 4096
    # A KV stream per slot: in deterministic mode, or asked for.
    assert scheduler(big, DETERMINISTIC="1").fit.pool_tokens(r, opts, 16) == 0
    assert scheduler(big, KV_POOL="off").fit.pool_tokens(r, opts, 16) == 0


def test_the_shared_buffer_falls_back_to_streams_where_its_pages_cannot_follow_use() -> None:
    from corral.runner.loadconfig import LoadConfig
    from corral.runner.process.loading import layout

    for start in (1, 0):  # elastic, or a fixed CORRAL_NUM_PARALLEL
        shared = LoadConfig(model="m", n_slots=16, kv_pool=16 * 4096, start_slots=start,
                            kv_shared=True)
        assert layout(shared, offloaded=False, pages_follow=True) == 16 * 4096
        assert layout(shared, offloaded=True, pages_follow=True) == 0  # a GPU's memory
        assert layout(shared, offloaded=False, pages_follow=False) == 0  # stock ggml
    # Pool mode is asked for: kept as it is, wherever the KV lives.
    pool = LoadConfig(model="m", n_slots=16, kv_pool=4096)
    assert layout(pool, offloaded=True, pages_follow=False) == 4096
    assert layout(LoadConfig(model="m", n_slots=4), offloaded=False, pages_follow=True) == 0



def test_a_gpu_backend_is_found_where_llama_cpp_lib_path_points(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU check builds llama.cpp on the spot and points llama-cpp-python at it; the
    # memory fit must see that build's CUDA backend, or it keeps every layer on the CPU.
    from corral.runner import fitestimate

    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    if fitestimate.gpu_backend_present():
        pytest.skip("this install's llama.cpp has a GPU backend of its own")
    (tmp_path / "libggml-cuda.so").write_bytes(b"")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert fitestimate.gpu_backend_present()


def test_the_daemon_asks_nvml_only_for_cuda_and_falls_back_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.runner import fitestimate, nvml

    assert nvml.free_bytes(str(tmp_path / "no-such-libnvidia-ml.so")) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nvml.free_bytes() is None  # NVML would count GPUs that CUDA may not use
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    if fitestimate.gpu_backend_present():
        pytest.skip("this install's llama.cpp has a GPU backend of its own")
    assert fitestimate.daemon_free_gpu_memory() == 0  # a CPU build: nothing asked of any GPU


def test_default_context_is_the_trained_length_as_memory_allows(tmp_path: Path) -> None:
    """CORRAL_CONTEXT_LENGTH auto: the trained length where one slot of it fits, else the
    most that fits (in steps of 1024), never under 4096; the same for a model all along."""
    long = GGUFInfo(**{**INFO.__dict__, "context_length": 131072})
    per_token = fitestimate.kv_bytes_per_token(long)
    assert fitestimate.context_that_fits(long, 64 << 30) == 131072
    assert fitestimate.context_that_fits(INFO, 64 << 30) == 8192  # its trained length
    mid = 2 << 30
    ctx = fitestimate.context_that_fits(long, mid)
    assert 32768 <= ctx < 131072 and ctx % 1024 == 0
    room = mid - fitestimate.memory_margin(mid) - fitestimate.estimate(long, 0, 1, 0).total
    assert ctx * per_token <= room < (ctx + 1024) * per_token
    assert fitestimate.context_that_fits(long, 100 * MB) == 4096  # the floor
    huge = GGUFInfo(**{**INFO.__dict__, "context_length": 1 << 20})
    assert fitestimate.context_that_fits(huge, 1 << 40) == 262144  # Ollama's top tier
    free = [64 << 30]
    s = Scheduler(load_settings({}), FakeRunner, free_memory=lambda: free[0],
                  free_vram=lambda: 0, total_memory=lambda: 64 << 30,
                  inspect=lambda r: long)
    r = rec(tmp_path)
    first = s.fit.default_ctx(r)
    free[0] = 600 * MB  # the model's own load took the memory: its context stays
    assert s.fit.default_ctx(r) == first == 131072
    assert s._load_options(Options(), r).num_ctx == 131072
    assert s._load_options(Options(num_ctx=2048), r).num_ctx == 2048
    fixed = Scheduler(load_settings({"CORRAL_CONTEXT_LENGTH": "8192"}), FakeRunner,
                      free_memory=lambda: 64 << 30, free_vram=lambda: 0,
                      total_memory=lambda: 64 << 30, inspect=lambda r: long)
    assert fixed._load_options(Options(), r).num_ctx == 8192


# Gemma 3 270M's shape (18 layers, one KV head of 256, a window of 512, trained to 32k):
# 15 of its layers attend within the window.
GEMMA3 = GGUFInfo(**{**INFO.__dict__, "architecture": "gemma3", "block_count": 18,
                     "head_count": 4, "head_count_kv": 1, "key_length": 256,
                     "value_length": 256, "context_length": 32768, "sliding_window": 512})


def test_a_window_cache_is_fitted_as_the_runner_makes_it(tmp_path: Path) -> None:
    """A sliding-window model's window layers hold each sequence's window and a batch
    (llama.cpp's size), its slots up to eight checkpoints of the window; not where the
    context is under four windows or under CORRAL_DETERMINISTIC (beside a projector too,
    as the runner makes it)."""
    per_layer = fitestimate.kv_bytes_per_token(GEMMA3) // 18
    assert per_layer == 1024
    assert fitestimate.window_layers(GEMMA3, 32768, True) == 15
    assert fitestimate.window_layers(GEMMA3, 2047, True) == 0  # under four windows
    assert fitestimate.window_layers(GEMMA3, 32768, False) == 0
    assert fitestimate.window_layers(INFO, 32768, True) == 0  # no window
    kv, kept = fitestimate.kv_bytes(GEMMA3, 32768, 4, window_cache=True)
    assert kv == per_layer * (3 * 32768 * 4 + 15 * (512 * 5 + 512))
    assert kept == per_layer * 15 * 8 * 4 * 512
    assert fitestimate.kv_bytes(GEMMA3, 32768, 4) == (per_layer * 18 * 32768 * 4, 0)
    est = fitestimate.estimate(GEMMA3, 32768, 4, 0, window_cache=True)
    assert (est.kv, est.checkpoints) == (kv // 18 * 18, kept)  # the KV split by layer
    assert est.total == est.weights + est.kv + est.compute + kept
    # the default context: what a full-size cache would cap at 8k, a window cache gives
    # whole
    budget = fitestimate.memory_margin(1 << 30) + fitestimate.estimate(GEMMA3, 8192, 1, 0).total
    budget += budget // 9  # the margin is a tenth of the budget
    assert fitestimate.context_that_fits(GEMMA3, budget) < 32768
    assert fitestimate.context_that_fits(GEMMA3, budget, window_cache=True) == 32768
    # the daemon's fit asks for it as the runner will make it
    for env, want in (({}, True), ({"CORRAL_DETERMINISTIC": "1"}, False)):
        s = Scheduler(load_settings(env), FakeRunner, free_memory=lambda: budget,
                      free_vram=lambda: 0, total_memory=lambda: 64 << 30,
                      inspect=lambda r: GEMMA3)
        assert s.fit._window_cache() is want
