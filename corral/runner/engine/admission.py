"""Pure rules for a job entering a slot: how its prompt fits, how long it may run."""

from __future__ import annotations

from typing import Sequence

from corral.errors import ContextOverflow
from corral.runner.jobs import ImageSpan, Job


def fit_prompt(job: Job, generated: list[int], num_ctx: int) -> list[int]:
    """The tokens to prefill: the prompt (and, for a preempted job, what it generated),
    cut to the context as Ollama truncates, keeping `num_keep` tokens at the start."""
    prompt = job.prompt + generated
    if len(prompt) < num_ctx:
        return prompt
    if job.images:  # a cut could fall inside an image, or drop one
        raise ContextOverflow(f"the input with its images ({len(prompt)} tokens) exceeds the"
                              f" context length ({num_ctx})")
    if not job.truncate and not generated:
        raise ContextOverflow(
            f"the input length ({len(prompt)} tokens) exceeds the context length ({num_ctx})")
    keep = max(0, min(job.num_keep if job.num_keep >= 0 else len(prompt), num_ctx // 2))
    tail = num_ctx - keep - 1
    return prompt[:keep] + prompt[len(prompt) - tail:]


def generation_limit(job: Job, n_prompt: int, num_ctx: int) -> int:
    """Most tokens to generate: num_predict, -1 for no limit (context shifts), -2 to fill
    the context."""
    if job.num_predict == -2:
        return max(1, num_ctx - n_prompt)
    if job.num_predict < 0:
        return 10 * num_ctx
    return max(job.num_predict, 0)


def align_prefix(spans: Sequence["ImageSpan"], n_prefix: int) -> int:
    """A cached prefix may end inside an image only if its tokens attend causally and
    each has a position of its own; otherwise (`ImageSpan.whole`) the whole image is
    decoded again, together."""
    for span in spans:
        if span.whole and span.start < n_prefix < span.end:
            return span.start
    return n_prefix
