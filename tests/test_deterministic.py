"""CORRAL_DETERMINISTIC means what it says, on every x86 level install.sh builds for: an
input embeds the same alone or in a batch of eight, on the chat and the base starter,
and a greedy request gives the same tokens before and after others that seed the draft
index differently (speculation on).

An embedding holds because deterministic mode decodes each input alone
(EmbeddingContext.per_decode): a matmul's rows are not computed alike at every batch
size on every CPU (llamafile's tiles on AVX2), so the test counts the decodes, and the
values alone against in a batch then agree whatever the kernels. A generation holds by
the batch-invariant kernels the mode asks for (no tiled matmul, no repacked weights,
GGML_CPU_USE_REF in install.sh's ggml), which the greedy test leans on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.registry.store import Store
from corral.runner.engine.engine import Engine
from corral.runner.llama.context import EngineConfig
from tests.support import DaemonFactory, embed

pytestmark = pytest.mark.model
MODELS = ["gemma3:270m-base", "smollm2:135m"]
TEXTS = ["a", "b", "The quick brown fox", "def f(x):\n    return x", "Once upon a time",
         "1 2 3 4", "Paris is the capital of France.", "zebra"]


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_deterministic_mode_embeds_each_input_in_a_decode_of_its_own(
        starter_gguf: Path) -> None:
    """The rule the next test's equality rests on: eight inputs are eight decodes in
    deterministic mode, and share one without it."""
    for deterministic, decodes in ((True, len(TEXTS)), (False, 1)):
        engine = Engine(str(starter_gguf), EngineConfig(num_ctx=256,
                                                        deterministic=deterministic))
        engine.start()
        try:
            tokens = [engine.tokenize(t) for t in TEXTS]
            together = embed(engine, tokens)
            assert engine.embed_ctx.decodes == decodes, deterministic
            if deterministic:
                assert [embed(engine, [t])[0] for t in tokens] == together
        finally:
            engine.stop()


def test_an_embedding_is_the_same_alone_and_in_a_batch(starter_store: Store,
                                                      daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, DETERMINISTIC="1", MAX_LOADED_MODELS="1")
    for model in MODELS:
        batch = post(d.url, "/api/embed", {"model": model, "input": TEXTS})["embeddings"]
        for text, together in zip(TEXTS, batch):
            alone = post(d.url, "/api/embed", {"model": model, "input": [text]})["embeddings"]
            assert alone[0] == together, (model, text)


def test_a_greedy_answer_does_not_depend_on_what_ran_before(
        starter_store: Store, daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, DETERMINISTIC="1", NUM_PARALLEL="1",
                       MAX_LOADED_MODELS="1")
    code = "class Account:\n    def __init__(self, balance):\n        self.balance = balance\n"
    probe = f"# account.py\n{code}\n# account.py again:\n"
    for model in MODELS:
        def ask(prompt: str, n: int = 48) -> str:
            return post(d.url, "/api/generate", {
                "model": model, "prompt": prompt, "raw": True, "stream": False,
                "options": {"temperature": 0, "seed": 1, "num_predict": n}})["response"]

        first = ask(probe)
        for i in range(20):  # others, which seed the draft index with other continuations
            ask(f"# account.py\n{code.replace('balance', f'amount{i}')}\n# again:\n", 16)
        assert ask(probe) == first, model
