"""The sampler's numpy preselection picks exactly what llama.cpp's own chain picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from corral.runner.llama.sampling import top_ids

pytestmark = pytest.mark.model


def test_top_ids_is_the_top_k_whatever_the_spread() -> None:
    rng = np.random.default_rng(0)
    for scale in (0.1, 3.0, 50.0):  # the threshold pass, its retries, and the fallback
        logits = (rng.standard_normal(262_144) * scale).astype(np.float32)
        for k in (1, 40, 100):
            assert set(top_ids(logits, k)) == set(np.argsort(logits)[-k:])
    flat = np.full(1000, -np.inf, dtype=np.float32)
    flat[[3, 7]] = 1.0
    assert set(top_ids(flat, 5)) >= {3, 7} and len(top_ids(flat, 5)) == 5


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
