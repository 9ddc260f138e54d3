"""Drafting with a model's own MTP head, on a tiny random Qwen3.5 the tests write
(tests/mtp_model.py: gated delta-net layers, an attention layer, one `nextn` block whose
head proposes about what the model chose last). The head drafts by default where
speculation is on; the model verifies every draft, so the output is plain decoding's,
logprobs and all, with batch-invariant kernels, alone and batched; the greedy answer is
llama.cpp's own loop's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.llama.context import EngineConfig, LlamaContext
from corral.runner.loadconfig import LoadConfig
from corral.runner.process.loading import load, mtp_head
from corral.runner.speculative.mtp import MtpHead
from tests.support import FlatCost, collect, llama_greedy, same_output

PROMPTS = ["Once upon a time", "The quick brown fox", "Zebras are"]
# A forced opening the head cannot foresee (it proposes the model's own next pick, which
# the grammar overrules: drafts rejected), then free text, where the model repeats itself
# and the head's drafts are kept.
GRAMMAR = 'root ::= "Once upon a time, there was a fox. " .*'
LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 8)


@pytest.fixture(scope="module")
def mtp_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.mtp_model import write_mtp

    return write_mtp(chat_gguf, tmp_path_factory.mktemp("mtp") / "qwen35.gguf")


def engine(path: Path, slots: int, spec: bool, **cache: Any) -> Engine:
    cfg = EngineConfig(n_slots=slots, num_ctx=512, deterministic=True, speculative=spec,
                       **cache)
    llama = LlamaContext(str(path), cfg)
    head = mtp_head(llama) if spec else None
    assert (head is not None) == spec == llama.mtp
    e = Engine(str(path), cfg, llama=llama, drafts=head, cost=FlatCost())
    e.start()
    return e


@pytest.fixture(scope="module")
def engines(mtp_gguf: Path) -> Iterator[dict[str, Engine]]:
    made = {"mtp": engine(mtp_gguf, 1, True), "plain": engine(mtp_gguf, 1, False),
            "mtp3": engine(mtp_gguf, 3, True)}
    yield made
    for e in made.values():
        e.stop()


def run(engine: Engine, prompt: list[int], n: int = 48, grammar: str | None = GRAMMAR
        ) -> tuple[list[Token], Done]:
    return collect(engine.submit(Job(prompt=prompt, params=SamplingParams(temperature=0, seed=1),
                                     logprobs=2, ignore_eos=True, num_predict=n,
                                     grammar=grammar)))


def test_a_model_with_an_mtp_layer_drafts_with_it_by_default(mtp_gguf: Path) -> None:
    on = load(LoadConfig(str(mtp_gguf), n_slots=1, num_ctx=256))
    off = load(LoadConfig(str(mtp_gguf), n_slots=1, num_ctx=256, speculative=False))
    try:
        assert isinstance(on.draft, MtpHead) and on.llama.mtp and on.draft_bytes == 0
        assert off.draft is None and not off.llama.mtp
        # the head's KV (one layer a position of the slot's context) is in the fit
        assert on.estimate.weights > off.estimate.weights
    finally:
        for loaded in (on, off):
            if loaded.draft is not None:
                loaded.draft.free()
            loaded.llama.free()


def test_mtp_drafts_change_nothing(engines: dict[str, Engine]) -> None:
    e = engines["mtp"]
    for text in PROMPTS:
        prompt = e.tokenize(text, add_special=True)
        on, off = run(e, prompt), run(engines["plain"], prompt)
        same_output(on, off)
        stats = on[1].stats
        assert stats.draft_accepted_count > 0  # the head's drafts were kept ...
        assert stats.draft_count > stats.draft_accepted_count  # ... and some taken back
        assert off[1].stats.draft_count == 0


def test_mtp_drafts_batched_are_each_alone(engines: dict[str, Engine]) -> None:
    e = engines["mtp3"]
    prompts = [e.tokenize(text, add_special=True) for text in PROMPTS]
    out: dict[int, Any] = {}
    gate = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        gate.wait(timeout=60)
        out[i] = run(e, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(out) == [0, 1, 2]
    # (How many drafts a batch verifies depends on when its sequences arrive and on the
    # step prices learned as it runs: only the output is asserted here.)
    for i, prompt in enumerate(prompts):
        same_output(out[i], run(engines["plain"], prompt))


def test_the_greedy_answer_with_mtp_is_llama_cpps(engines: dict[str, Engine]) -> None:
    e = engines["mtp"]
    prompt = e.tokenize(PROMPTS[1], add_special=True)
    tokens, done = run(e, prompt, n=32, grammar=None)
    assert done.stats.draft_accepted_count > 0
    assert list(done.stats.context)[len(prompt):] == llama_greedy(e.llama.model, prompt, 32)


def test_mtp_drafts_after_a_regenerate(engines: dict[str, Engine]) -> None:
    """A regenerate goes back to a checkpoint: the head reads on from there, with no
    state for the rows the slot kept."""
    e = engines["mtp"]
    prompt = e.tokenize(PROMPTS[2], add_special=True)
    first = run(e, prompt)
    again = run(e, prompt)
    assert again[1].stats.prompt_eval_count < len(prompt)
    same_output(first, again)
    assert again[1].stats.draft_accepted_count > 0


def test_mtp_drafts_after_a_return_from_ram_and_a_resume_from_disk(
        mtp_gguf: Path, tmp_path: Path, engines: dict[str, Engine]) -> None:
    """Two chats alternate on one slot (the first goes to the RAM cache and comes back
    to its checkpoint), then the runner stops and the next one resumes the chat from the
    disk tier: the head reads on from each restore, and every answer is plain
    decoding's (free text: the model repeats itself, and the head's drafts are kept)."""
    cache = {"cache_ram": 64 << 20, "cache_disk": 256 << 20, "cache_dir": str(tmp_path)}
    plain = engines["plain"]
    first = engine(mtp_gguf, 1, True, **cache)
    try:
        prompt = first.tokenize(LONG, add_special=True)
        tokens = list(run(first, prompt, grammar=None)[1].stats.context)
        run(first, first.tokenize("Zebras graze on the open plain.", add_special=False), n=4)
        back = tokens[:-3] + [tokens[-1]]
        out = run(first, back, n=24, grammar=None)
        assert out[1].stats.prompt_eval_count < len(back)  # from the RAM cache
        assert out[1].stats.draft_accepted_count > 0
        same_output(out, run(plain, back, n=24, grammar=None))
        tokens = list(out[1].stats.context)
    finally:
        first.stop()
    second = engine(mtp_gguf, 1, True, **cache)
    try:
        resumed = tokens[:-3] + [tokens[-1]]
        out = run(second, resumed, n=24, grammar=None)
    finally:
        second.stop()
    assert out[1].stats.prompt_eval_count < len(resumed)  # from the disk tier
    assert out[1].stats.draft_accepted_count > 0
    same_output(out, run(plain, resumed, n=24, grammar=None))


def test_a_sidecar_head_named_as_the_draft_drafts_for_its_model(
        chat_gguf: Path, tmp_path: Path, engines: dict[str, Engine]) -> None:
    """A model converted without its MTP layers, and its head alone in a GGUF of its
    own (a sidecar) named as the DRAFT: the head drafts from the model's hidden states,
    and the output is plain decoding's."""
    from tests.mtp_model import write_mtp

    model = write_mtp(chat_gguf, tmp_path / "model.gguf", head=False)
    sidecar = write_mtp(chat_gguf, tmp_path / "head.gguf", trunk=False)
    alone = load(LoadConfig(str(model), n_slots=1, num_ctx=256))
    assert alone.draft is None and not alone.llama.mtp  # no head of its own: n-grams
    alone.llama.free()
    loaded = load(LoadConfig(str(model), n_slots=1, num_ctx=256, draft=str(sidecar)))
    assert isinstance(loaded.draft, MtpHead) and loaded.llama.mtp and not loaded.draft_error
    assert loaded.draft_bytes > 0  # its weights and its one layer's KV, in the fit
    e = Engine(str(model), loaded.engine_config, llama=loaded.llama, drafts=loaded.draft,
               cost=FlatCost())
    e.start()
    try:
        prompt = e.tokenize(PROMPTS[1], add_special=True)
        out = run(e, prompt)
    finally:
        e.stop()
    same_output(out, run(engines["plain"], prompt))
    assert out[1].stats.draft_accepted_count > 0
