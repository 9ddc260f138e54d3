"""Image tokens into a slot's sequence: checks, prefix alignment and the embeddings batch.

A prompt holds an image as a run of one negative placeholder id (runner.llama.vision).
Text prefill stops at a placeholder (runner.engine.batchplan); the engine then feeds the
image's embeddings through a batch of its own, a slice per step, between the
token batches, so the streams beside it advance at every step. An image whose
tokens attend to each other both ways (Gemma 3) cannot be split: it goes in one
batch, with causal attention off for that decode only.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import llama_cpp as L

from corral.errors import BadRequest
from corral.runner.slots.slot import Slot, SlotState

if TYPE_CHECKING:
    from corral.runner.jobs import ImageSpan, Job

# Image tokens decoded per step, when the projector allows splitting. It bounds what a
# step adds for the streams beside the image; measured here with batch-invariant kernels,
# slices of 16 to 48 rows gave bit-identical logits, a whole 64-token image in one
# decode did not.
SLICE = 32


def check_images(job: "Job", n_vocab: int, n_batch: int) -> None:
    """Every negative id must belong to an image span, and every span to its ids."""
    owned = bytearray(len(job.prompt))
    for span in job.images:
        if span.start < 0 or span.end > len(job.prompt) or any(
                t != span.key for t in job.prompt[span.start:span.end]):
            raise BadRequest("image placeholders do not match the prompt")
        if span.non_causal and span.n_tokens > n_batch:
            raise BadRequest(f"an image takes {span.n_tokens} tokens in one batch, more than"
                             f" num_batch ({n_batch}) allows")
        owned[span.start:span.end] = b"\x01" * span.n_tokens
    for i, t in enumerate(job.prompt):
        if t >= n_vocab or (t < 0 and not owned[i]):
            raise BadRequest("prompt contains invalid token ids")


def waiting(slots: list[Slot]) -> Slot | None:
    """The oldest prefilling slot whose next prompt token is an image's."""
    ready = [s for s in slots if s.state is SlotState.PREFILL and s.pending and s.pending[0] < 0]
    return min(ready, key=lambda s: s.t_start) if ready else None


def span_at(job: "Job", index: int) -> "ImageSpan":
    for span in job.images:
        if span.start <= index < span.end:
            return span
    raise BadRequest("image placeholders do not match the prompt")


class ImageFeed:
    """The embeddings batch, used only by the engine thread."""

    def __init__(self, ctx: Any, n_batch: int, n_embd: int) -> None:
        self.ctx, self.n_batch, self.n_embd = ctx, n_batch, n_embd
        self.batch: Any = None  # allocated at the first image

    def slice(self, slot: Slot) -> tuple["ImageSpan", int, int]:
        """The slot's image, the offset into it, and how many rows this step decodes."""
        assert slot.job is not None
        span = span_at(slot.job, slot.n_past)
        offset = slot.n_past - span.start
        left = span.n_tokens - offset
        return span, offset, left if span.non_causal else min(left, SLICE, self.n_batch)

    def decode(self, slot: Slot, span: "ImageSpan", offset: int, count: int,
               logits_last: bool) -> int:
        if self.batch is None:
            self.batch = L.llama_batch_init(self.n_batch, self.n_embd, 1)
        rows = span.embd[offset:offset + count]
        assert rows.shape == (count, self.n_embd) and 0 < count <= self.n_batch
        batch = self.batch
        ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
        for i in range(count):
            batch.pos[i] = slot.n_past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot.seq_id
            batch.logits[i] = logits_last and i == count - 1
        batch.n_tokens = count
        if span.non_causal:
            L.llama_set_causal_attn(self.ctx, False)
        try:
            return int(L.llama_decode(self.ctx, batch))
        finally:
            if span.non_causal:
                L.llama_set_causal_attn(self.ctx, True)

    def free(self) -> None:
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
