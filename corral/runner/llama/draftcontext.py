"""A draft model's context (a Modelfile's DRAFT): a smaller model loaded beside the model,
which proposes tokens for it to verify (runner.speculative.draftmodel decides what it
decodes; this makes the native calls). Only the engine thread touches it, as it does the
model's own context.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import llama_cpp as L
import numpy as np

from corral.errors import RunnerError
from corral.runner.llama import native

log = logging.getLogger("corral.draft")

BATCH = 512

Row = tuple[int, int, int, bool]  # token, position, sequence, wants logits


class DraftContext:
    def __init__(self, path: str, n_seqs: int, cells: int, n_threads: int,
                 n_gpu_layers: int, kv_type: int, flash_attn: int) -> None:
        """`n_seqs` sequences sharing `cells` KV cells of `kv_type`, with the model's
        flash attention setting (runner.llama.context)."""
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RunnerError(f"llama.cpp could not load the draft model {path}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = cells, n_seqs
        cparams.n_batch = cparams.n_ubatch = BATCH
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # One stream for all sequences: drafts need no batch invariance (verification
        # is exact whatever they are), and a short sequence leaves room to a long one.
        cparams.kv_unified = cparams.swa_full = True
        cparams.embeddings, cparams.no_perf = False, True
        cparams.type_k = cparams.type_v = kv_type
        cparams.flash_attn_type = flash_attn
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RunnerError("llama.cpp could not create the draft model's context")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(BATCH, 0, 1)
        # Its proposals are kept past a step only if its cells can be cut back to where
        # they were accepted: not in a recurrent or hybrid memory.
        self.can_rollback = not (L.llama_model_is_recurrent(self.model)
                                 or L.llama_model_is_hybrid(self.model))

    def remove(self, seq: int, start: int) -> None:
        """Drop the sequence's cells from position `start` on."""
        L.llama_memory_seq_rm(self.mem, seq, start, -1)

    def decode(self, rows: Sequence[Row]) -> dict[int, tuple[int, float]] | None:
        """Decode `rows` in batches; after each row with logits, the draft model's most
        likely next token and its probability, by sequence. None when a decode failed
        (the shared cells are full): the context is then empty."""
        picks: dict[int, tuple[int, float]] = {}
        for start in range(0, len(rows), BATCH):
            chunk = rows[start:start + BATCH]
            native.fill_batch(self.batch, chunk, BATCH)
            if L.llama_decode(self.ctx, self.batch) != 0:
                log.warning("the draft model's decode failed; its context starts over")
                L.llama_memory_clear(self.mem, True)
                return None
            for i, (_, _, seq, wanted) in enumerate(chunk):
                if wanted:
                    picks[seq] = self._pick(i)
        return picks

    def _pick(self, row: int) -> tuple[int, float]:
        logits: Any = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row),
                                            shape=(self.n_vocab,))
        top = int(np.argmax(logits))
        return top, float(1.0 / np.exp(logits - logits[top]).sum())

    def set_threads(self, n: int) -> None:
        L.llama_set_n_threads(self.ctx, n, n)

    def free(self) -> None:
        native.free_model(self.batch, self.ctx, self.model)
        self.batch = self.ctx = self.model = None
