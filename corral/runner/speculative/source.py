"""Where drafts come from: one interface for the n-gram index (runner.speculative.ngram)
and a draft model (runner.speculative.draftmodel), behind speculation's one owner
(runner.speculative.speculation), which alone decides what each sequence drafts and
keeps the drafts made.

After a step, speculation asks its source once for the drafts of every sequence it
chose (`propose`: a sequence id, its tokens, how many at most); the source hears each
sequence's tokens as they come (`add`), and the rows each model decode read
(`decoded`: a model's MTP head reads them with the model's hidden states,
runner.speculative.mtp). A source whose drafts cost compute of their own
(`priced`: a draft model's decode, a row per token) is asked only for drafts that pay
for their rows; the index's lookups cost nothing, so its drafts are made whole and cut
after.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence


class History:
    """One sequence's tokens as the sources see them: its prompt, then what it generated.
    The index points into this list, so a continuation grows as the sequence does."""

    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.indexed = 0  # tokens[:indexed] are in the n-gram index as continuations


class Want(NamedTuple):
    seq: int
    history: History
    n: int  # how many tokens to propose at most
    # The position the model reads the sequence's last token at: its index, save past an
    # M-RoPE image or a context shift (-1: not told)
    pos: int = -1


Row = tuple[int, int, int, bool]  # a decoded row: token, position, sequence, had logits


class DraftSource(Protocol):
    priced: bool  # each drafted token costs a row of the source's own decode

    def add(self, history: History) -> None:
        """A sequence's new tokens (its prompt, then each sampled one)."""

    def decoded(self, rows: Sequence[Row]) -> None:
        """The model just decoded `rows`, in batch order (before any other decode)."""

    def propose(self, wants: Sequence[Want]) -> dict[int, list[int]]:
        """A continuation for each wanting sequence, at most its count: sequence id ->
        tokens (a sequence left out, or given [], drafts nothing)."""
        ...

    def bytes(self) -> int:
        """Host memory the source holds for its drafts (ps counts it)."""
        ...

    def set_threads(self, n: int) -> None:
        """The threads the model's decodes use now (a source with decodes follows)."""

    def free(self) -> None:
        """The engine stops: native memory goes."""
