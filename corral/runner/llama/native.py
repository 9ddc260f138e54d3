"""Thin, checked access to llama.cpp's C API through llama-cpp-python's ctypes bindings.

Only the engine thread calls into a model or context; these helpers hold no
state of their own beyond the process-wide backend and log hook.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from typing import Any, Sequence

import llama_cpp as L

from corral.process import apply_native_defaults, trim_malloc

_log_hook: Any = None


def init_backend(verbose: bool = False, deterministic: bool = False) -> None:
    """Initialise ggml once and route llama.cpp's logging (silent unless verbose).
    Deterministic mode's knobs are set at every call: ggml's CPU backend reads them
    when each context is made, and a process that made another model's context first
    (a test suite's) must not lose them."""
    global _log_hook
    apply_native_defaults(deterministic)
    if _log_hook is not None:
        return

    def _log(level: int, text: bytes, _user: Any) -> None:
        if verbose and text:
            os.write(2, text)

    # Keep a reference: ctypes would free the trampoline and llama.cpp would crash.
    _log_hook = L.llama_log_callback(_log)
    L.llama_log_set(_log_hook, ctypes.c_void_p(0))
    L.llama_backend_init()


def free_model(batch: Any, ctx: Any, model: Any) -> None:
    """Free a llama_batch, a context and the model under them, in that order; each may
    be None (already freed, or never made)."""
    if batch is not None:
        L.llama_batch_free(batch)
    if ctx:
        L.llama_free(ctx)
    if model:
        L.llama_model_free(model)


def cleared(since: int = 0) -> tuple[int, list[tuple[int, int]]] | None:
    """The zero clears of CPU buffers that handed their pages back (madvise) instead of
    writing them, as install.sh builds ggml (corral_ggml_cleared): how many so far, and
    the page ranges of those from the `since`-th on (ggml logs the last 64). None where
    ggml is not built so, and a clear writes every page."""
    fn = _cleared_fn()
    if fn is None or not sys.platform.startswith("linux"):  # elsewhere the clear writes
        return None
    out = (ctypes.c_size_t * 128)()
    n = int(fn(since, out, 64))
    pairs = [(int(out[2 * k]), int(out[2 * k + 1])) for k in range(min(max(n - since, 0), 64))]
    return n, pairs


def kv_pages(ctx: Any) -> list[tuple[int, int]] | None:
    """The page ranges of a new, empty context's memory (its KV buffers), as ggml logs
    them (cleared): clearing the memory, with nothing in it yet, logs exactly its
    buffers. Cleared twice, so that another buffer's clear between the two (a context
    being made, a logits buffer a decode grew) counts in neither; and one context at a
    time, so that two contexts' clears never interleave. None where ggml's clear writes
    its pages, or logged none of them."""
    with _pages_lock:
        before = cleared()
        if before is None:
            return None
        mem = L.llama_get_memory(ctx)
        L.llama_memory_clear(mem, True)
        first = cleared(before[0])
        L.llama_memory_clear(mem, True)
        second = cleared(first[0])  # type: ignore[index]
    again = set(first[1])  # type: ignore[index]
    return [r for r in second[1] if r in again] or None  # type: ignore[index]


_pages_lock = threading.Lock()


@functools.cache
def _cleared_fn() -> Any:
    """install.sh's corral_ggml_cleared, typed once; None in a stock build."""
    fn = getattr(L.llama_cpp._lib, "corral_ggml_cleared", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
        fn.restype = ctypes.c_uint64
    return fn


def specials_present(vocab: Any) -> bool:
    """Whether every token llama_tokenize adds with add_special exists: it asserts (and
    aborts the process) on a vocabulary that asks for a BOS, EOS or, WordPiece's, SEP it
    does not have, where llama-server would die on the first prompt."""
    null, wpm = L.LLAMA_TOKEN_NULL, L.llama_vocab_type(vocab) == L.LLAMA_VOCAB_TYPE_WPM
    return not ((L.llama_vocab_get_add_bos(vocab) or wpm) and L.llama_vocab_bos(vocab) == null
                or L.llama_vocab_get_add_eos(vocab) and L.llama_vocab_eos(vocab) == null
                or wpm and L.llama_vocab_sep(vocab) == null)


# LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE (include/llama.h): llama.cpp's
# n_pos_per_embd is 4 for these, so embeddings take four positions each and KV cells
# keep a 2-D position beside their own (llama_kv_cell_ext).
_MROPE = (8, 40)


def mrope(model: Any) -> bool:
    """Whether the model's RoPE is M-RoPE (Qwen2-VL and later)."""
    return int(L.llama_model_rope_type(model)) in _MROPE


def meta(model: Any, key: str) -> str:
    """A GGUF metadata value of the model as text; "" where it has none."""
    buf = ctypes.create_string_buffer(256)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def tokenize(vocab: Any, text: str | bytes, add_special: bool, parse_special: bool = True
             ) -> list[int]:
    """llama_tokenize; add_special adds nothing where a token it would add is missing."""
    add_special = add_special and specials_present(vocab)
    data = text.encode("utf-8") if isinstance(text, str) else text
    capacity = len(data) + 16
    buf = (L.llama_token * capacity)()
    n = L.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    if n < 0:
        capacity = -n
        buf = (L.llama_token * capacity)()
        n = L.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    if n < 0:
        raise ValueError("prompt could not be tokenized")
    return list(buf[:n])


def token_bytes(vocab: Any, token: int, special: bool = False) -> bytes:
    """Raw bytes of one token; may be part of a multi-byte UTF-8 character. A token the
    vocabulary does not have (LLAMA_TOKEN_NULL, -1: a GGUF without an EOS or BOS id) is
    no text: llama.cpp would index its table with it and abort."""
    if not 0 <= token < L.llama_vocab_n_tokens(vocab):
        return b""
    buf = ctypes.create_string_buffer(64)
    n = L.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = L.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[: max(n, 0)]


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise).

    A grammar sampler builds tables over the whole vocabulary and the embedding
    context has its own compute buffer; once freed, without this the runner's
    resident size would stay at its peak for good.
    """
    trim_malloc()


def fill_batch(batch: Any, rows: Sequence[tuple[int, int, int, bool]], capacity: int) -> None:
    """Write (token, position, sequence, wants logits) rows into a llama_batch.

    The capacity check stands before native code: llama_decode aborts the
    process on an overfull batch instead of returning an error.
    """
    if len(rows) > capacity:
        raise RuntimeError(f"batch overflow: {len(rows)} > {capacity}")
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(rows)

