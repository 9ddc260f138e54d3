"""The sampler's numpy preselection picks exactly what llama.cpp's own chain picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from corral.runner.llama.sampling import top_ids

pytestmark = pytest.mark.model


def top_values(logits: np.ndarray, k: int) -> list[float]:
    return sorted(np.sort(logits)[-k:].tolist())


def test_top_ids_is_the_top_k_whatever_the_spread() -> None:
    rng = np.random.default_rng(0)
    for n in (262_144, 49_152, 262_143, 1000):  # columns of 128, an odd size, a small one
        for scale in (0.1, 3.0, 50.0):
            logits = (rng.standard_normal(n) * scale).astype(np.float32)
            for k in (1, 40, 100):
                ids = top_ids(logits, k)
                assert len(set(ids.tolist())) == k and list(ids) == sorted(ids)
                assert sorted(logits[ids].tolist()) == top_values(logits, k)
    flat = np.full(1000, -np.inf, dtype=np.float32)
    flat[[3, 7]] = 1.0
    assert set(top_ids(flat, 5)) >= {3, 7} and len(top_ids(flat, 5)) == 5
    odd = np.zeros(32_064, dtype=np.float32)  # Phi-3's vocabulary: 64 ids past the columns
    odd[[32_063, 32_000, 17]] = (3.0, 2.0, 1.0)
    assert list(top_ids(odd, 3)) == [17, 32_000, 32_063]
    broken = (rng.standard_normal(262_144)).astype(np.float32)
    broken[99] = np.nan  # a NaN logit still leaves k ids to sample from
    assert len(top_ids(broken, 40)) == 40


def test_top_ids_finds_the_best_where_they_crowd_one_column() -> None:
    """All of the top k in one column of the search (token j + i * 2048), and ties at
    the least of the columns' bests: still exactly the k largest values."""
    logits = np.zeros(262_144, dtype=np.float32)
    width = 262_144 // 128
    logits[5 + width * np.arange(60)] = 10.0 + np.arange(60)  # one column holds 60 bests
    logits[np.arange(1000, 1100)] = 1.0  # a hundred columns tied below them
    for k in (1, 40, 60, 80):
        ids = top_ids(logits, k)
        assert len(set(ids.tolist())) == k
        assert sorted(logits[ids].tolist()) == top_values(logits, k)
    assert set(top_ids(logits, 40)) == set((5 + width * np.arange(20, 60)).tolist())


@pytest.mark.parametrize("options", [
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 7},
    {"temperature": 1.5, "top_k": 100, "top_p": 0.95, "min_p": 0.02, "seed": 3},
    {"temperature": 0.7, "repeat_penalty": 1.3, "seed": 11},
    {"temperature": 0.0, "repeat_penalty": 1.2},
])
def test_preselection_matches_the_full_chain(starter_gguf: Path, options: dict) -> None:
    import llama_cpp as L

    from corral.runner.llama import native
    from corral.runner.llama.context import EngineConfig, LlamaContext
    from corral.options import Options
    from corral.runner.jobs import SamplingParams
    from corral.runner.llama.sampling import Sampler

    native.init_backend()
    llama = LlamaContext(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=256))
    try:
        prompt = native.tokenize(llama.vocab, "Once upon a time", True)
        native.fill_batch(llama.batch, [(t, i, 0, i == len(prompt) - 1)
                                        for i, t in enumerate(prompt)], llama.n_batch)
        assert L.llama_decode(llama.ctx, llama.batch) == 0
        params = SamplingParams.from_options(Options.parse(options))
        banned = [1, 106]  # as ignore_eos bans end-of-generation tokens
        fast = Sampler(params, llama.vocab, llama.n_vocab, 256, banned=banned)
        full = Sampler(params, llama.vocab, llama.n_vocab, 256, banned=banned, preselect=False)
        row = len(prompt) - 1
        picks = [(fast.sample(llama.ctx, row), full.sample(llama.ctx, row)) for _ in range(40)]
        assert all(a == b for a, b in picks), picks
        assert not {a for a, _ in picks} & set(banned)
        fast.free()
        full.free()
    finally:
        llama.free()
