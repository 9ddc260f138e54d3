"""The part of a sequence's state that no cut reaches (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
a recurrent state, a sliding window's KV): what it holds, measured when a model loads,
and whether a window cache still holds a cut sequence's whole window.

A window cache (runner.llama.context) overwrites a cell once its position has left the
window and the cache's ring comes round to it, so the KV of a position a little out of
the window is usually still there: a cut within a window of a sequence's end usually
finds every position the next token sees, and this tells whether it did. llama.cpp
writes a sequence's window part as a fixed header and, per cell still in the window
(llama_kv_cache::state_write), the same bytes: the size of that part counts the cells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp as L

PARTIAL = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def measure(model: Any, n_threads: int, n: int, flags: int = PARTIAL) -> int:
    """The partial state's bytes (or with `flags` 0 the whole state's) of one sequence
    that has read `n` tokens, in a context of that one sequence (one KV stream); 0 where
    it could not be made."""
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.no_perf = True
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        return 0
    try:
        bos = max(int(L.llama_vocab_bos(L.llama_model_get_vocab(model))), 0)
        tokens = (L.llama_token * n)(*[bos] * n)
        if L.llama_decode(ctx, L.llama_batch_get_one(tokens, n)) != 0:
            return 0
        return int(L.llama_state_seq_get_size_ext(ctx, 0, flags))
    finally:
        L.llama_free(ctx)


@dataclass(frozen=True)
class Window:
    """A window cache's partial state: `fixed` bytes in a context of one KV stream, and
    `per_cell` for each cell of the `size` positions of the window."""

    size: int
    fixed: int
    per_cell: int

    @classmethod
    def measured(cls, model: Any, n_threads: int, size: int) -> "Window":
        one, two = measure(model, n_threads, 1), measure(model, n_threads, 2)
        return cls(size, one - (two - one), two - one)

    @property
    def state_bytes(self) -> int:
        """One sequence's whole window: what a checkpoint of it holds."""
        return self.fixed + self.per_cell * self.size

    def whole(self, ctx: Any, seq: int, n: int, streams: int) -> bool:
        """Whether the sequence, cut to `n` positions, holds the KV of every position of
        the window before `n` (in a context of `streams` KV streams: each stream past
        the first adds an empty count to the state)."""
        size = int(L.llama_state_seq_get_size_ext(ctx, seq, PARTIAL))
        cells = size - self.fixed - 4 * (streams - 1)
        return self.per_cell > 0 and cells == self.per_cell * min(n, self.size)
