"""Which fill-in-the-middle tokens a GGUF has, found as llama.cpp finds them
(src/llama-vocab.cpp): the `tokenizer.ggml.fim_*_token_id` keys (and the deprecated
`prefix`/`suffix`/`middle` ones), else a token whose text is one a model family is known
to use. The daemon reads this for `show`'s `insert` capability and for /infill's 400
before anything loads; the runner takes the ids themselves from llama.cpp's vocabulary."""

from __future__ import annotations

from typing import Mapping

# The roles /infill needs, in the order llama-server names the missing ones.
NEEDED = (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))

KEYS: dict[str, tuple[str, ...]] = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}

# llama-vocab.cpp's "auto-detect special tokens by text" lists, role by role.
TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}

# What the GGUF reader keeps of the vocabulary: the token texts above, as bytes.
WANTED = frozenset(t.encode() for texts in TEXTS.values() for t in texts)


def fim_roles(metadata: Mapping[str, object], found: frozenset[str],
              n_vocab: int) -> frozenset[str]:
    """The FIM roles ("pre", "suf", "mid", "rep", "sep") the model has: a key naming a
    token inside the vocabulary, or one of `found` (the token texts of TEXTS the
    vocabulary holds)."""
    roles = set()
    for role, keys in KEYS.items():
        ids = [metadata.get(k) for k in keys]
        if any(isinstance(i, int) and 0 <= i < n_vocab for i in ids):
            roles.add(role)
        elif found.intersection(TEXTS[role]):
            roles.add(role)
    return frozenset(roles)


def missing(roles: frozenset[str]) -> str:
    """llama-server's reason /infill cannot run, or "" when it can."""
    return "".join(f"{name} token is missing. " for role, name in NEEDED if role not in roles)
