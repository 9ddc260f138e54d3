"""Reranking in the runner: each document's prompt as llama-server builds it
(format_prompt_rerank in tools/server/server-common.cpp). The wire records of POST
/rerank are in runner/rankwire.py, which the daemon imports without llama.cpp.

A GGUF with a `rerank` chat template (Qwen3-Reranker's, as convert_hf_to_gguf writes it)
has `{query}` and `{document}` replaced and the text tokenized with control tokens read as
such and no BOS added; otherwise the prompt is [BOS] query [EOS] [SEP] doc [EOS], each
special token where the vocabulary's flags ask for it (EOS falling back to SEP). The
score is the first of the pooled classifier outputs (llama-server's send_rerank).
"""

from __future__ import annotations

from typing import Any

import llama_cpp as L

from corral.runner.llama import native


def is_reranker(model: Any) -> bool:
    """The GGUF asks for rank pooling (`<arch>.pooling_type` 4), as llama-server's
    `--reranking` does of the model it serves."""
    arch = native.meta(model, "general.architecture")
    return native.meta(model, f"{arch}.pooling_type") == str(int(L.LLAMA_POOLING_TYPE_RANK))


def rerank_template(model: Any) -> str | None:
    """The GGUF's `tokenizer.chat_template.rerank`, if it has one."""
    raw = L.llama_model_chat_template(model, b"rerank")
    return raw.decode("utf-8", "replace") if raw else None


def prompt_tokens(vocab: Any, template: str | None, query: str, doc: str) -> list[int]:
    """One document's prompt, token for token as llama-server's format_prompt_rerank."""
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", doc)
        return native.tokenize(vocab, text, False, True)
    eos = L.llama_vocab_eos(vocab)
    if eos == L.LLAMA_TOKEN_NULL:
        eos = L.llama_vocab_sep(vocab)
    bos = [L.llama_vocab_bos(vocab)] if L.llama_vocab_get_add_bos(vocab) else []
    end = [eos] if L.llama_vocab_get_add_eos(vocab) else []
    sep = [L.llama_vocab_sep(vocab)] if L.llama_vocab_get_add_sep(vocab) else []
    # A vocabulary without the special token (LLAMA_TOKEN_NULL) gets none: llama-server
    # would put -1 in the batch, which llama_decode refuses.
    bos, end, sep = ([t for t in ids if t != L.LLAMA_TOKEN_NULL] for ids in (bos, end, sep))
    return (bos + native.tokenize(vocab, query, False, False) + end + sep
            + native.tokenize(vocab, doc, False, False) + end)
