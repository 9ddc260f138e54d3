"""Embeddings in their own context, opened with embeddings=True on first use.

A generation context must not have embeddings on: llama.cpp would then compute
262k-wide logits for every prompt token. Pooling follows the model; a model
without a pooling type (a plain causal LM) is mean-pooled. A reranker (rank pooling)
pools to its classifier's outputs, one per label, and llama-server's score is the first.

Several inputs are evaluated together: up to SEQS sequences, as many as fit the
context's cells, in one llama_decode (llama.cpp pools each sequence on its own), so a
request of many short inputs (a rerank's documents) is a few batches, not one each.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import llama_cpp as L

from corral.errors import BadRequest, Cancelled, ContextOverflow, CorralError, RunnerError
from corral.runner.llama import native
from corral.runner.jobs import Embed, Failed


MIN_CAPACITY = 512
SLICE = 8  # inputs embedded between two decode steps
SEQS = SLICE  # sequences in one embedding batch: a slice fits one decode when short


class EmbeddingContext:
    """The embedding context, sized to the inputs it has seen rather than to num_ctx.

    Its KV and compute buffers grow with its capacity, so a daemon that embeds
    short texts keeps a small context, and one long input reopens it larger.
    """

    def __init__(self, model: Any, num_ctx: int, n_threads: int,
                 adapters: tuple[Any, Any, int] | None = None, alone: bool = False) -> None:
        self.model = model
        # One input a decode (deterministic mode): a matmul's rows are not computed alike
        # at every batch size on every CPU (llamafile's tiles on AVX2), so an input
        # embeds the same alone or sent with others only when it is always alone.
        self.per_decode = 1 if alone else SEQS
        self.adapters = adapters  # (handles, scales, count), as set on the main context
        self.num_ctx = num_ctx
        self.n_threads = n_threads
        self.ctx: Any = None
        self.batch: Any = None
        self.capacity = 0
        self.pooling: int | None = None  # the model's, or mean for a plain causal LM
        self.n_embd = int(L.llama_model_n_embd(model))
        self.decodes = 0  # batches evaluated: the tests see documents share them
        self.encoder_only = bool(L.llama_model_has_encoder(model)
                                 and not L.llama_model_has_decoder(model))

    @property
    def width(self) -> int:
        """Floats per pooled output: a reranker's labels, else the embedding length."""
        if self.pooling == L.LLAMA_POOLING_TYPE_RANK:
            return max(1, int(L.llama_model_n_cls_out(self.model)))
        return self.n_embd

    def set_threads(self, n: int) -> None:
        """Engine thread: the runner's share of the cores, now and for later contexts."""
        self.n_threads = n
        if self.ctx is not None:
            L.llama_set_n_threads(self.ctx, n, n)

    def _open(self, pooling: int, capacity: int) -> None:
        cparams = L.llama_context_default_params()
        cparams.n_ctx = capacity
        cparams.n_batch = cparams.n_ubatch = capacity  # one input = one ubatch
        cparams.n_seq_max = SEQS
        cparams.kv_unified = True  # the sequences of a batch share the cells, not split them
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.embeddings = True
        cparams.pooling_type = pooling
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RunnerError("llama.cpp could not create an embedding context")
        if self.adapters:
            L.llama_set_adapters_lora(self.ctx, *self.adapters)

    def _ensure(self, longest: int) -> None:
        if self.ctx is not None and longest <= self.capacity:
            return
        self.free()
        capacity = MIN_CAPACITY
        while capacity < longest:
            capacity *= 2
        capacity = min(capacity, self.num_ctx)
        if self.pooling is None:
            self._open(L.LLAMA_POOLING_TYPE_UNSPECIFIED, capacity)
            self.pooling = int(L.llama_pooling_type(self.ctx))
            if self.pooling != L.LLAMA_POOLING_TYPE_NONE:
                self._finish_open(capacity)
                return
            L.llama_free(self.ctx)
            self.pooling = L.LLAMA_POOLING_TYPE_MEAN
        self._open(self.pooling, capacity)
        self._finish_open(capacity)

    def _finish_open(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch = L.llama_batch_init(capacity, 0, 1)

    def embed(self, inputs: list[list[int]], truncate: bool) -> list[list[float]]:
        """Raw pooled outputs, one per input, in order."""
        for tokens in inputs:
            if not tokens:
                raise BadRequest("cannot embed an empty input")
            if len(tokens) > self.num_ctx and not truncate:
                raise ContextOverflow("the input length exceeds the context length")
        inputs = [tokens[: self.num_ctx] for tokens in inputs]
        self._ensure(max(len(t) for t in inputs))
        out: list[list[float]] = []
        for group in _groups(inputs, self.capacity, self.per_decode):
            out.extend(self._pool(group))
        return out

    def _pool(self, group: list[list[int]]) -> list[list[float]]:
        """One decode of `group`'s sequences (seq i is group[i]); each one's pooled output."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        native.fill_batch(self.batch, [(tok, i, seq, True) for seq, tokens in enumerate(group)
                                       for i, tok in enumerate(tokens)], self.capacity)
        rc = (L.llama_encode if self.encoder_only else L.llama_decode)(self.ctx, self.batch)
        if rc != 0:
            raise RunnerError(f"embedding failed ({rc})")
        self.decodes += 1
        width, out = self.width, []
        for seq in range(len(group)):
            ptr = L.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                raise RunnerError("the model produced no pooled embedding")
            out.append([float(ptr[i]) for i in range(width)])
        return out

    def free(self) -> None:
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            L.llama_free(self.ctx)
            self.ctx = None
        self.capacity = 0


def _groups(inputs: list[list[int]], cells: int, most: int = SEQS) -> list[list[list[int]]]:
    """`inputs` in order, cut into runs of at most `most` whose tokens fit `cells`."""
    groups: list[list[list[int]]] = []
    used = cells
    for tokens in inputs:
        if used + len(tokens) > cells or len(groups[-1]) == most:
            groups.append([])
            used = 0
        groups[-1].append(tokens)
        used += len(tokens)
    return groups


class EmbedQueue:
    """Embed commands (runner.jobs) in arrival order, worked through a slice per engine step.

    A large batch never stalls the streams decoding beside it for long, and a
    cancelled one stops at its next slice. Used only by the engine thread.
    """

    def __init__(self) -> None:
        self.pending: deque[Embed] = deque()
        self.vectors: list[list[float]] = []  # so far, for the oldest request

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, command: Embed) -> None:
        self.pending.append(command)

    def step(self, embed_ctx: EmbeddingContext) -> None:
        command = self.pending[0]
        try:
            if command.cancelled.is_set():
                raise Cancelled("embedding cancelled")
            done = len(self.vectors)
            self.vectors.extend(embed_ctx.embed(command.inputs[done:done + SLICE],
                                                command.truncate))
            if len(self.vectors) < len(command.inputs):
                return
            command.reply.put(self.vectors)
        except CorralError as exc:
            command.reply.put(Failed(exc))
        self.pending.popleft()
        self.vectors = []

    def fail_all(self, error: CorralError) -> None:
        for command in self.pending:
            command.reply.put(Failed(error))
        self.pending.clear()
        self.vectors = []
