"""A prompt tokenized from a recent prompt's tokens (runner.llama.prompttokens) is what
llama_tokenize gives for the whole text: on the chat starter's BPE vocabulary, the base
starter's SPM one, and a copy of the second whose `<mask>` strips the whitespace before
it (llama.cpp gives it LSTRIP under a jina-v2 pre-tokenizer), where Gemma's special runs
of newlines are no place to cut."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import llama_cpp as L
import pytest

from corral.runner.llama import native
from corral.runner.llama.prompttokens import KEEP, MIN_BYTES, PromptTokens, Specials

WORDS = ["the", "cat", "naïve", "日本語", "🙂", "x=1;", "  ", "\n", "\n\n", "\t", "def f():",
         "<", ">", "|", "ok.", "Hello", "world", "  indented", "end"]


def _vocab(path: Path) -> Iterator[tuple[Any, Any]]:
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        yield model, L.llama_model_get_vocab(model)
    finally:
        L.llama_model_free(model)


@pytest.fixture(scope="module")
def bpe(chat_gguf: Path) -> Iterator[tuple[Any, Any]]:
    yield from _vocab(chat_gguf)


@pytest.fixture(scope="module")
def spm(starter_gguf: Path) -> Iterator[tuple[Any, Any]]:
    yield from _vocab(starter_gguf)


@pytest.fixture(scope="module")
def stripping(starter_gguf: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Any, Any]]:
    target = tmp_path_factory.mktemp("lstrip") / "mask-lstrip.gguf"
    tool = Path(sys.executable).parent / "gguf-new-metadata"
    subprocess.run([str(tool), "--pre-tokenizer", "jina-v2-code", "--force", str(starter_gguf),
                    str(target)], check=True, capture_output=True, timeout=300)
    yield from _vocab(target)


def _specials(vocab: Any) -> list[str]:
    """Markup tokens' texts (<|im_start|>, <start_of_turn>, ...) and runs of newlines
    (special in Gemma's vocabulary), with halves of them (a prompt cut inside one)."""
    every = sorted(t.decode() for texts in Specials(vocab).by_length.values() for t in texts)
    texts = [t for t in every if t.startswith("<") and t.endswith(">") and "unused" not in t]
    texts = texts[:8] + [t for t in every if t.strip() == ""][:4]
    assert len(texts) >= 4
    return texts + [t[:len(t) // 2] for t in texts] + [t[len(t) // 2:] for t in texts]


def _text(rng: random.Random, specials: list[str], n: int) -> str:
    return "".join(rng.choice(specials) if rng.random() < 0.2 else rng.choice(WORDS) + " "
                   for _ in range(n))


def _replay(model: Any, vocab: Any, seed: int, steps: int = 150) -> PromptTokens:
    """Conversations as clients send them (new, regenerated, extended, edited at any
    character, returned to), each prompt checked against llama_tokenize."""
    prompts = PromptTokens(vocab, native.meta(model, "tokenizer.ggml.model"))
    assert prompts.enabled
    rng, specials = random.Random(seed), _specials(vocab)
    chats = [_text(rng, specials, 80)]
    for _ in range(steps):
        i = rng.randrange(len(chats))
        op = rng.choice(["new", "same", "extend", "extend", "edit", "edit"])
        if op == "new":
            chats.append(_text(rng, specials, 80))
            i = len(chats) - 1
        elif op == "extend":
            chats[i] += _text(rng, specials, rng.randrange(1, 20))
        elif op == "edit":
            chats[i] = chats[i][:rng.randrange(len(chats[i]))] + _text(rng, specials, 5)
        add = rng.random() < 0.7
        assert prompts.tokenize(chats[i], add) == native.tokenize(vocab, chats[i], add), op
    return prompts


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_prompts_tokenized_from_recent_ones_equal_llama_tokenize(
        which: str, request: pytest.FixtureRequest) -> None:
    model, vocab = request.getfixturevalue(which)
    total = 0
    for seed in range(3):
        prompts = _replay(model, vocab, seed)
        total += prompts.reused
    assert total > 5_000  # a fifth to a quarter of the tokens came from kept prompts


def test_no_cut_after_a_special_run_of_newlines_a_later_strip_may_take(
        stripping: tuple[Any, Any]) -> None:
    """`<mask>` strips the newlines before it, a special token of their own once the
    prompt before was cut after them: the cut goes back to `<end_of_turn>`."""
    model, vocab = stripping
    prompts = PromptTokens(vocab, native.meta(model, "tokenizer.ggml.model"))
    specials = Specials(vocab)
    assert specials.lstrip and specials.attrs[native.tokenize(vocab, "\n\n", False)[0]]
    head = "<start_of_turn>user\n" + "word " * 100 + "<end_of_turn>"
    for text in (head + "\n\nnext" * 10, head + "\n\n  <mask> next"):
        assert prompts.tokenize(text, False) == native.tokenize(vocab, text, False)
    assert prompts.reused == len(native.tokenize(vocab, head, False))
    assert _replay(model, vocab, 7).reused > 1_000


def test_a_special_tokens_text_across_a_cut_is_seen(bpe: tuple[Any, Any]) -> None:
    _, vocab = bpe
    specials = Specials(vocab)
    text = b"abcd <|im_start|> efgh"
    start, end = 5, 5 + len("<|im_start|>")
    assert all(specials.across(text, cut) for cut in range(start + 1, end))
    assert not specials.across(text, start) and not specials.across(text, end)


def test_short_prompts_are_tokenized_whole(bpe: tuple[Any, Any]) -> None:
    model, vocab = bpe
    prompts = PromptTokens(vocab, native.meta(model, "tokenizer.ggml.model"))
    text = "<|im_start|>user\nhi<|im_end|>"
    assert len(text.encode()) < MIN_BYTES
    for _ in range(2):
        assert prompts.tokenize(text, True) == native.tokenize(vocab, text, True)
    assert prompts.reused == 0


def test_a_prompt_sent_again_and_again_keeps_one_entry(bpe: tuple[Any, Any]) -> None:
    """Eight regenerates of one chat leave another chat's prompt kept."""
    model, vocab = bpe
    prompts = PromptTokens(vocab, native.meta(model, "tokenizer.ggml.model"))
    first = "<|im_start|>user\n" + "one " * 100 + "<|im_end|>\n"
    second = "<|im_start|>user\n" + "two " * 100 + "<|im_end|>\n"
    prompts.tokenize(first, False)
    for _ in range(KEEP + 1):
        prompts.tokenize(second, False)
    reused = prompts.reused
    text = first + "<|im_start|>assistant\n"
    assert prompts.tokenize(text, False) == native.tokenize(vocab, text, False)
    # every token up to its last special token, <|im_end|>, came from the kept prompt
    assert prompts.reused - reused == len(native.tokenize(vocab, first[:-1], False))
