"""Pure tests of fill-in-the-middle: llama-server's prompt layout and budgets on token
lists (runner/fim.py), which FIM tokens a GGUF's metadata names (registry/fim.py),
/infill's request defaults and its stop rules (n_indent, t_max_predict_ms)."""

from __future__ import annotations

import pytest

from corral.api.wire import parse
from corral.api.wire.infill import InfillRequest
from corral.errors import BadRequest
from corral.registry.fim import fim_roles, missing
from corral.runner.fim import NULL, FimTokens, Infill, infill_tokens
from corral.server.dialects.infill import Limits

PRE, SUF, MID, REP, SEP, BOS = 1, 2, 3, 4, 5, 6
FIM = FimTokens(pre=PRE, suf=SUF, mid=MID)
SPECIAL: list[str] = []  # the texts tokenized with control tokens read as tokens


def toy(text: str, special: bool) -> list[int]:
    """One token per character (its code point + 100)."""
    if special:
        SPECIAL.append(text)
    return [100 + ord(c) for c in text]


def t(text: str) -> list[int]:
    return toy(text, False)


def test_prefix_suffix_middle() -> None:
    assert infill_tokens(Infill("ab", "cd"), FIM, toy, 4096) == \
        [PRE, *t("ab"), SUF, *t("cd"), MID]


def test_bos_leads_and_the_prompt_ends_the_prefix() -> None:
    SPECIAL.clear()
    fim = FimTokens(pre=PRE, suf=SUF, mid=MID, bos=BOS)
    assert infill_tokens(Infill("ab", "cd", prompt="P"), fim, toy, 4096) == \
        [BOS, PRE, *t("ab"), *t("P"), SUF, *t("cd"), MID]
    assert SPECIAL == ["P"]  # only the prompt reads control tokens' text as tokens


def test_repo_level_form_names_each_file() -> None:
    fim = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP, bos=BOS)
    extra = (("a.py", "x=1"), ("b.py", "y"))
    got = infill_tokens(Infill("p", "s", extra), fim, toy, 4096)
    assert got == [REP, *t("myproject\n"), SEP, *t("a.py\n"), *t("x=1"), SEP, *t("b.py\n"),
                   *t("y"), SEP, *t("filename\n"), BOS, PRE, *t("p"), SUF, *t("s"), MID]


def test_without_fim_sep_files_are_snippets() -> None:
    fim = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP)  # SmolLM2's vocabulary has a rep
    got = infill_tokens(Infill("p", "s", (("a.py", "x"),)), fim, toy, 4096)
    assert got == [REP, *t("myproject\n"), *t("\n\n--- snippet ---\n\n"), *t("x"),
                   PRE, *t("p"), SUF, *t("s"), MID]


def test_no_extra_and_no_rep_means_no_head() -> None:
    fim = FimTokens(pre=PRE, suf=SUF, mid=MID, sep=SEP)
    assert infill_tokens(Infill("p", "s"), fim, toy, 4096)[:3] == [SEP, *t("fi")]


def test_budgets_keep_the_prefix_tail_and_the_suffix_head() -> None:
    # n_batch 16: the prefix keeps its last 12 tokens, the suffix its first 4 - (2 + prompt).
    got = infill_tokens(Infill("0123456789abcdefgh", "ABCDEFGH", prompt="P"), FIM, toy,
                        4096, n_batch=16)
    assert got == [PRE, *t("6789abcdefgh"), *t("P"), SUF, *t("A"), MID]
    # A prompt longer than the suffix's quarter leaves no suffix at all.
    got = infill_tokens(Infill("x", "ABCDEFGH", prompt="PPPP"), FIM, toy, 4096, n_batch=16)
    assert got == [PRE, *t("x"), *t("PPPP"), SUF, MID]


def test_extra_fills_what_the_context_leaves_from_its_tail() -> None:
    fim = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP)
    extra = (("a", "0123456789"),)
    # n_ctx - n_batch - 2 * n_predict = 40 - 16 + 2 = 26 of the extra's 36 tokens.
    head = [REP, *t("myproject\n"), SEP, *t("a\n"), *t("0123456789"), SEP, *t("filename\n")]
    got = infill_tokens(Infill("p", "s", extra), fim, toy, 40, n_batch=16)
    assert got == head[-26:] + [PRE, *t("p"), SUF, *t("s"), MID]
    assert infill_tokens(Infill("p", "s", extra), fim, toy, 10, n_batch=16)[0] == PRE


def test_a_model_without_fim_tokens_is_a_400_that_says_which() -> None:
    with pytest.raises(BadRequest) as err:
        infill_tokens(Infill("p", "s"), FimTokens(pre=PRE, suf=NULL, mid=NULL), toy, 4096)
    assert str(err.value) == ("Infill is not supported by this model: suffix token is "
                              "missing. middle token is missing. ")


def test_infill_travels_to_the_runner_and_back() -> None:
    infill = Infill("p", "s", (("a.py", "x"),), "q")
    assert Infill.from_json(infill.to_json()) == infill
    with pytest.raises(BadRequest):
        Infill.from_json({"prefix": 3})


def test_roles_from_keys_and_from_token_text() -> None:
    keys = {"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.suffix_token_id": 8,
            "tokenizer.ggml.fim_mid_token_id": 99}  # 99: outside a vocabulary of 50
    assert fim_roles(keys, frozenset(), 50) == {"pre", "suf"}
    assert fim_roles(keys, frozenset({"<fim_middle>", "<|file_sep|>"}), 50) == \
        {"pre", "suf", "mid", "sep"}
    assert fim_roles({}, frozenset({"<reponame>"}), 50) == {"rep"}  # SmolLM2
    assert missing(frozenset({"rep"})) == ("prefix token is missing. suffix token is "
                                          "missing. middle token is missing. ")
    assert missing(frozenset({"pre", "suf", "mid"})) == ""


def test_request_takes_llama_servers_sampling_defaults() -> None:
    wire = parse(InfillRequest, {"input_prefix": "a", "input_suffix": "b"})
    assert wire.options() == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                              "repeat_penalty": 1.0, "num_predict": -1}
    wire = parse(InfillRequest, {"input_prefix": "a", "input_suffix": "b", "temperature": 0,
                                 "seed": 3, "stop": ["\n"], "n_predict": 8})
    assert wire.options()["temperature"] == 0 and wire.options()["stop"] == ["\n"]
    with pytest.raises(BadRequest, match="input_suffix"):
        parse(InfillRequest, {"input_prefix": "a"})
    with pytest.raises(BadRequest, match="input_extra"):
        parse(InfillRequest, {"input_prefix": "a", "input_suffix": "", "input_extra": [{}]})


def test_n_indent_ends_at_a_line_indented_less() -> None:
    limits = Limits(n_indent=4, t_max_ms=0)
    sent = []
    for piece in ["    x = 1", "\n", "    y", "\n", "z = 2", "\n"]:
        if not limits.stopped:
            sent.append(limits.feed(piece))
    assert sent[-1] == "" and limits.stopped  # "z = 2" starts a line indented 0
    assert "".join(sent) == "    x = 1\n    y\n"


def test_t_max_predict_ms_ends_at_a_new_line_after_the_time() -> None:
    now = [0.0]
    limits = Limits(n_indent=0, t_max_ms=100, clock=lambda: now[0])
    assert limits.feed("a") == "a" and not limits.stopped
    now[0] = 0.5
    assert limits.feed("b") == "b" and not limits.stopped  # no new line yet
    assert limits.feed("\n") == "\n" and limits.stopped


@pytest.mark.parametrize("shift", range(-36, 13, 4))  # its length, or its text, across
def test_vocabulary_texts_are_found_across_read_blocks(shift: int) -> None:
    """The GGUF reader reads the vocabulary a block at a time; a FIM token text that
    straddles two blocks is found all the same."""
    import io
    import struct

    from corral.registry.ggufio import BLOCK, Reader

    def entry(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text

    filler = entry(b"x" * 1000)
    count = (BLOCK + shift) // len(filler)
    pad = entry(b"y" * ((BLOCK + shift) % len(filler)))
    data = filler * count + pad + entry(b"<fim_prefix>") + entry(b"<|file_sep|>")
    reader = Reader(io.BytesIO(data), len(data))
    found = reader.skip_strings(count + 3, "tokens", frozenset({b"<fim_prefix>",
                                                               b"<|file_sep|>"}))
    assert found == {b"<fim_prefix>", b"<|file_sep|>"} and reader.pos == len(data)
