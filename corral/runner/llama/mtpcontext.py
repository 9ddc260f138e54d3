"""A model's own multi-token-prediction head (its GGUF's `nextn` layers: Qwen3.5 and
others), in a context of its own beside the model's (LLAMA_CONTEXT_TYPE_MTP, as
llama-server's draft-mtp makes it). runner.speculative.mtp decides what it decodes; this
makes the native calls, on the engine thread only, as for the model's own context.

The head reads a token with the model's hidden state at the position before it (the
state the model's graph marks `h_nextn`, after the output norm for Qwen3.5, which
llama.cpp hands out when a context's "nextn embeddings" are on), and gives the logits of
the token after. Its KV holds one layer's cells a position, in one stream for every
sequence.

The pinned llama.cpp exports the nextn-embedding calls from C++ only (src/llama-ext.h),
so they are found by their Itanium-mangled names (Linux and macOS); where they are not
found the model runs without its head.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Sequence

import llama_cpp as L
import numpy as np

from corral.errors import RunnerError

log = logging.getLogger("corral.draft")

TOP_K = 10  # llama-server's draft-mtp sampler: the top ten, renormalized
_FLOATS = ctypes.POINTER(ctypes.c_float)
Row = tuple[int, int, int, Any, bool]  # token, position, sequence, hidden state, logits


def _symbol(name: str, args: list[Any], res: Any) -> Any:
    fn = getattr(L.llama_cpp._lib, name, None)
    if fn is not None:
        fn.argtypes, fn.restype = args, res
    return fn


_SET = _symbol("_Z26llama_set_embeddings_nextnP13llama_contextbb",
               [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)
_GET = _symbol("_Z26llama_get_embeddings_nextnP13llama_context", [ctypes.c_void_p], _FLOATS)
_GET_ITH = _symbol("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                   [ctypes.c_void_p, ctypes.c_int32], _FLOATS)


def available() -> bool:
    """Whether this libllama hands out the hidden states an MTP head reads."""
    return None not in (_SET, _GET, _GET_ITH)


def hidden_states_on(ctx: Any) -> None:
    """Make every row a decode of `ctx` computes keep its hidden state (for the head's
    catch-up: each token of a prompt is read with the state before it)."""
    _SET(ctx, True, False)


def hidden_states(ctx: Any, n_rows: int, n_embd: int) -> np.ndarray | None:
    """A copy of the hidden states of the last decode's `n_rows` rows, in batch order
    (None: it kept none)."""
    ptr = _GET(ctx)
    return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd)).copy() if ptr else None


class MtpContext:
    def __init__(self, model: Any, n_seqs: int, cells: int, n_batch: int,
                 n_threads: int, kv_type: int, flash_attn: int, owned: bool = False) -> None:
        """The head of `model` (loaded with load_mtp), for `n_seqs` sequences sharing
        `cells` KV cells; `owned`: the model is a sidecar's, freed with the head."""
        self.model = model if owned else None
        cparams = L.llama_context_default_params()
        cparams.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        cparams.n_ctx, cparams.n_seq_max = cells, n_seqs
        cparams.n_batch = cparams.n_ubatch = n_batch
        # Logits for a drafting row a sequence, not for every row a catch-up reads (the
        # buffer is rows x vocabulary: 512 MB at a 248k vocabulary and 512 rows)
        cparams.n_outputs_max = n_seqs
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # Drafts need no batch invariance (verification is exact whatever they are), and
        # one stream lets a long sequence use what a short one leaves.
        cparams.kv_unified = True
        cparams.n_rs_seq = 0
        cparams.embeddings, cparams.no_perf = False, True
        cparams.type_k = cparams.type_v = kv_type
        cparams.flash_attn_type = flash_attn
        self.ctx = L.llama_init_from_model(model, cparams)
        self.batch: Any = None
        if not self.ctx:
            self.free()
            raise RunnerError("llama.cpp could not create the MTP head's context")
        _SET(self.ctx, True, True)  # the state after each drafted token feeds the next
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.n_embd = int(L.llama_model_n_embd_out(model))
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        self.batch = L.llama_batch_ext_init(self.ctx)
        self._pos = (ctypes.c_int32 * 4)()

    def remove(self, seq: int, start: int) -> None:
        """Drop the sequence's cells from position `start` on."""
        L.llama_memory_seq_rm(self.mem, seq, start, -1)

    def last(self, seq: int) -> int:
        """The sequence's last position in the head's cells (-1: none)."""
        return int(L.llama_memory_seq_pos_max(self.mem, seq))

    def decode(self, rows: Sequence[Row]) -> bool:
        """Decode `rows` in batches of n_batch (only the last batch's logits stay). False
        when a decode failed (the cells are full, a position llama.cpp refused): the
        head's cells then start over, every sequence's."""
        for start in range(0, len(rows), self.n_batch):
            if not self._decode(rows[start:start + self.n_batch]):
                log.warning("the MTP head's decode failed; its cells start over")
                L.llama_memory_clear(self.mem, True)
                return False
        return True

    def _decode(self, rows: Sequence[Row]) -> bool:
        batch, pos = self.batch, self._pos
        L.llama_batch_ext_clear(batch)
        held = []  # the states must live until the decode has read them
        for token, p, seq, h, logits in rows:
            idx = L.llama_batch_ext_add_token(batch, seq, token)
            pos[0] = p
            h = np.ascontiguousarray(h, dtype=np.float32)
            held.append(h)
            if idx < 0 or not L.llama_batch_ext_set_pos(batch, idx, pos) or not \
                    L.llama_batch_ext_set_embd_token(
                        batch, idx, L.llama_embd(h.ctypes.data_as(_FLOATS), 1, self.n_embd)):
                return False
            if logits:
                L.llama_batch_ext_set_output_logits(batch, idx, True)
        return L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0

    def pick(self, row: int) -> tuple[int, float, np.ndarray]:
        """After the last decode, at `row` of its batch: the head's most likely token,
        its probability among the top ten (llama-server's draft sampler), and the state
        its next draft reads."""
        logits: Any = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row),
                                            shape=(self.n_vocab,))
        top = np.argpartition(logits, -TOP_K)[-TOP_K:]
        best = int(top[np.argmax(logits[top])])
        p = float(1.0 / np.exp(logits[top] - logits[best]).sum())
        state = np.ctypeslib.as_array(_GET_ITH(self.ctx, row), shape=(self.n_embd,)).copy()
        return best, p, state

    def set_threads(self, n: int) -> None:
        L.llama_set_n_threads(self.ctx, n, n)

    def free(self) -> None:
        if self.batch is not None:
            L.llama_batch_ext_free(self.batch)
        if self.ctx:
            L.llama_free(self.ctx)
        if self.model is not None:
            L.llama_model_free(self.model)
        self.batch = self.ctx = self.model = None
