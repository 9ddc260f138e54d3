"""Image tokens into a slot's sequence: checks, and which slice of which image a step takes.

A prompt holds an image as a run of one negative placeholder id (runner.llama.vision).
Text prefill stops at a placeholder (runner.engine.batchplan); schedule then plans one
slice of the image, which run feeds through an embeddings batch of its own after the
token batch (runner.engine.run ImageFeed), a slice per step, so the streams beside it
advance at every step. An image whose tokens attend to each other both ways (Gemma 3)
cannot be split: it goes in one batch, with causal attention off for that decode only.
Pure: no llama.cpp here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from corral.errors import BadRequest
from corral.runner.engine.plan import ImageSlice
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


def next_slice(slot: Slot, n_batch: int) -> ImageSlice:
    """The slice of the slot's image the next step decodes: the image, the offset into it,
    and how many rows (a non-causal image goes whole)."""
    assert slot.job is not None
    span = span_at(slot.job, slot.n_past)
    offset = slot.n_past - span.start
    left = span.n_tokens - offset
    count = left if span.non_causal else min(left, SLICE, n_batch)
    return ImageSlice(slot, span, offset, count, last=count == len(slot.pending))
