"""Per-slot sampling: a llama.cpp sampler chain per request, grammar by rejection.

Top-k runs first: with a 262k-token vocabulary every later stage is cheap only
on a short candidate list. A grammar is never in the chain (about 56 ms per
token over the full vocabulary); instead the chain samples freely and the
grammar checks that one token, falling back to a grammar pass over all logits
only when it rejects, as llama.cpp's common sampler does.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L
import numpy as np

from corral.errors import InvalidOption
from corral.runner.jobs import Job, SamplingParams
from corral.runner.wire import Logprob

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)


COLUMN = 128  # top_ids sees the vocabulary as columns of this many: j, j + width, ...


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, in id order, without partitioning the whole
    vocabulary: one pass takes each column's best (a strided view, no copy), the k best
    columns are found among a few thousand, and since k columns reach the least of their
    bests, so does every one of the k largest logits: only those k columns (and the last
    few ids, where the vocabulary is not a multiple of COLUMN) are searched. The same
    values as a full partition; which of two equal logits is taken may differ."""
    n = len(logits)
    width = n // COLUMN
    if k <= 0:
        return np.empty(0, dtype=np.int32)
    if width <= k:  # a small vocabulary: one partition is cheap
        return _partitioned(logits, k)
    head = width * COLUMN
    view = logits[:head].reshape(COLUMN, width)
    bests = view.max(axis=0)
    cols = np.argpartition(bests, -k)[-k:]
    floor = bests[cols].min()
    if floor != floor:  # a NaN logit: columns cannot be ranked
        return _partitioned(logits, k)
    rows, which = np.nonzero(np.take(view, cols, axis=1) >= floor)
    ids = rows * width + cols[which]
    if head < n:
        ids = np.concatenate([ids, np.arange(head, n)])
    if len(ids) > k:  # ties at the floor, other columns' seconds above it, the last ids
        ids = ids[np.argpartition(logits[ids], -k)[-k:]]
    return np.sort(ids).astype(np.int32)


def _partitioned(logits: np.ndarray, k: int) -> np.ndarray:
    ids = np.argpartition(logits, -k)[-k:] if k < len(logits) else np.arange(len(logits))
    return np.sort(ids).astype(np.int32)


def compile_grammar(vocab: Any, gbnf: str) -> Any:
    """A grammar sampler, or InvalidOption if the grammar does not parse."""
    sampler = L.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    if not sampler:
        raise InvalidOption("invalid grammar for structured output")
    return sampler


class Sampler:
    """One request's sampler. Owned and used only by the engine thread."""

    def __init__(self, params: SamplingParams, vocab: Any, n_vocab: int, num_ctx: int,
                 grammar: str | None = None, banned: list[int] | None = None,
                 preselect: bool = True, logprobs: int = -1) -> None:
        self.n_vocab = n_vocab
        self.vocab = vocab
        self.logprobs = logprobs  # -1: off; else how many alternatives each token reports
        self.entries: list[Logprob] = []  # since the last emitted piece
        self.chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        self.grammar = compile_grammar(vocab, grammar) if grammar else None
        self._candidates: np.ndarray | None = None
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if banned:  # ignore_eos: end-of-generation tokens can never be chosen
            biases = (L.llama_logit_bias * len(banned))(
                *(L.llama_logit_bias(t, float("-inf")) for t in banned))
            add(L.llama_sampler_init_logit_bias(n_vocab, len(banned), biases))
        last_n = num_ctx if params.repeat_last_n < 0 else params.repeat_last_n
        greedy = params.temperature <= 0
        # The chain would copy the whole vocabulary into a candidate list for every
        # token (1.2 ms on a 262k vocabulary, a tenth of a CPU decode step at four
        # streams). When its first stage is top-k, or it is plain greedy, numpy finds
        # those candidates in a fraction of that and the chain runs on them alone.
        self._banned = np.array(banned, dtype=np.int64) if banned and preselect else None
        self._argmax = preselect and greedy and not params.penalized()
        self._top_k = 0
        if params.top_k > 0 and (not greedy or params.penalized()):
            add(L.llama_sampler_init_top_k(params.top_k))
            self._top_k = min(params.top_k, n_vocab) if preselect else 0
        if params.penalized():
            add(L.llama_sampler_init_penalties(n_vocab, last_n, params.repeat_penalty,
                                               params.frequency_penalty,
                                               params.presence_penalty))
        if greedy:
            add(L.llama_sampler_init_greedy())
            return
        if params.typical_p < 1.0:
            add(L.llama_sampler_init_typical(params.typical_p, 1))
        if params.top_p < 1.0:
            add(L.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(L.llama_sampler_init_min_p(params.min_p, 1))
        add(L.llama_sampler_init_temp(params.temperature))
        seed = L.LLAMA_DEFAULT_SEED if params.seed < 0 else params.seed & 0xFFFFFFFF
        add(L.llama_sampler_init_dist(seed))

    def remember(self, tokens: list[int]) -> None:
        """Feed prompt tokens to the penalty history."""
        for tok in tokens:
            L.llama_sampler_accept(self.chain, tok)

    def sample(self, ctx: Any, index: int) -> int:
        """Sample (and accept) the next token from the logits at batch `index`."""
        token = self._choose(ctx, index)
        if self.logprobs >= 0:
            self.entries.append(self._logprob_entry(ctx, index, token))
        return token

    def take_logprobs(self) -> tuple[Logprob, ...]:
        entries, self.entries = tuple(self.entries), []
        return entries

    def _logprob_entry(self, ctx: Any, index: int, token: int) -> Logprob:
        """The chosen token's log-probability under the model, with the most likely
        alternatives: from the same logits row the sampler just read."""
        from corral.runner.llama.native import token_bytes

        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index),
                                       shape=(self.n_vocab,)).astype(np.float64)
        top = float(np.max(logits))
        norm = top + float(np.log(np.sum(np.exp(logits - top))))

        def entry(tok: int, top: tuple[Logprob, ...] = ()) -> Logprob:
            raw = token_bytes(self.vocab, tok)
            return Logprob(raw.decode("utf-8", "replace"), float(logits[tok] - norm),
                           tuple(raw), top)

        if self.logprobs <= 0:
            return entry(token)
        best = top_ids(logits, self.logprobs)
        best = best[np.argsort(-logits[best], kind="stable")]
        return entry(token, tuple(entry(int(t)) for t in best))

    def _choose(self, ctx: Any, index: int) -> int:
        if self.grammar is not None:
            return self._sample_with_grammar(ctx, index)
        if not (self._argmax or self._top_k):
            return int(L.llama_sampler_sample(self.chain, ctx, index))
        ptr = L.llama_get_logits_ith(ctx, index)
        if not ptr:
            raise RuntimeError("no logits at batch index")
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if self._banned is not None:
            logits[self._banned] = -np.inf  # this row's logits are ours alone to use
        if self._argmax:
            token = int(np.argmax(logits))
        else:
            ids = top_ids(logits, self._top_k)
            cands = np.zeros(len(ids), dtype=_TOKEN_DATA)
            cands["id"], cands["logit"] = ids, logits[ids]
            arr = L.llama_token_data_array(
                cands.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), len(ids), -1, False)
            L.llama_sampler_apply(self.chain, ctypes.byref(arr))
            token = int(cands["id"][arr.selected])
        L.llama_sampler_accept(self.chain, token)
        return token

    def _fill(self, ctx: Any, index: int) -> tuple[np.ndarray, Any]:
        ptr = L.llama_get_logits_ith(ctx, index)
        if not ptr:
            raise RuntimeError("no logits at batch index")
        if self._candidates is None:
            self._candidates = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        cands = self._candidates
        cands["id"] = np.arange(self.n_vocab, dtype=np.int32)
        cands["logit"] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        cands["p"] = 0.0
        arr = L.llama_token_data_array(
            cands.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), self.n_vocab, -1, False)
        return cands, arr

    def _sample_with_grammar(self, ctx: Any, index: int) -> int:
        _, arr = self._fill(ctx, index)
        L.llama_sampler_apply(self.chain, ctypes.byref(arr))
        token = int(arr.data[arr.selected].id)
        single = (L.llama_token_data * 1)(L.llama_token_data(token, 1.0, 0.0))
        one = L.llama_token_data_array(single, 1, -1, False)
        L.llama_sampler_apply(self.grammar, ctypes.byref(one))
        if single[0].logit == float("-inf"):
            cands, arr = self._fill(ctx, index)
            L.llama_sampler_apply(self.grammar, ctypes.byref(arr))
            if not np.isfinite(cands["logit"]).any():
                # llama.cpp aborts the process if a grammar that cannot go on is made to
                # accept an end token: this request ends here instead, with its own 400.
                raise InvalidOption("the grammar allows no token at this point of the output"
                                    " (no character of the vocabulary continues it)")
            L.llama_sampler_apply(self.chain, ctypes.byref(arr))
            token = int(arr.data[arr.selected].id)
        L.llama_sampler_accept(self.grammar, token)
        L.llama_sampler_accept(self.chain, token)
        return token

    def free(self) -> None:
        if self.chain:
            L.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            L.llama_sampler_free(self.grammar)
            self.grammar = None


def for_job(job: Job, prompt: list[int], vocab: Any, n_vocab: int, num_ctx: int,
            eog: Any = None) -> Sampler:
    """A new sequence's sampler, with the prompt's tail remembered for the penalties."""
    sampler = Sampler(job.params, vocab, n_vocab, num_ctx, job.grammar, eog,
                      logprobs=job.logprobs)
    if job.params.penalized():
        history = prompt[-max(job.params.repeat_last_n, 0) or None:]
        sampler.remember([t for t in history if t >= 0])  # image placeholders: no tokens
    return sampler
