"""Drafting with the model's own MTP head (runner.llama.mtpcontext): a draft source
(runner.speculative.source) as llama-server's draft-mtp is one.

The head predicts the token after next from a token and the model's hidden state at the
position before it. So its cells must follow the model's: after every decode of the
model (`decoded`), each row's token goes into the head with the state of the row before
it (the first row of a sequence with the last state kept for it), which costs one
layer's decode of every row the model reads. To draft (`propose`), a sequence's next
token goes in with the state that predicted it, and each drafted token with the state
the head gave with it, while the head is sure of its pick (P_MIN, among its top ten as
llama-server's sampler sees it) and up to the count asked. The drafted cells go again
after, as llama-server removes them: the model's next decode writes those positions.

What the head's cells hold is checked only against its positions: where the model
holds positions the head never read (a restore, a branch, an image), the sequence's
cells start over from the next rows, and a slot whose state was copied in at a position
the head had written keeps the head's cells of what the slot held before. Either costs
acceptance, never exactness (the model verifies every draft). A sequence's drafts start
at the position the model reads its next token at (Want.pos: past an M-RoPE image or a
context shift, not its token count).
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import numpy as np

from corral.runner.speculative.draftmodel import N_MAX, P_MIN
from corral.runner.speculative.source import History, Row, Want

# The rows of a sequence's last decode whose states are kept: the one that predicted its
# next token is among the last (a verifying batch's accepted rows), one more than the
# longest draft.
KEEP = 33
HeadRow = tuple[int, int, int, np.ndarray, bool]  # ... with the hidden state it reads


class Head(Protocol):
    """The native side (runner.llama.mtpcontext.MtpContext)."""

    n_embd: int

    def remove(self, seq: int, start: int) -> None: ...

    def last(self, seq: int) -> int: ...

    def decode(self, rows: Sequence[HeadRow]) -> bool: ...

    def pick(self, row: int) -> tuple[int, float, np.ndarray]: ...

    def set_threads(self, n: int) -> None: ...

    def free(self) -> None: ...


class MtpHead:
    priced = True  # each drafted token is a row of the head's decode

    def __init__(self, head: Head, states: "StatesOf", n_max: int = 0) -> None:
        """`states(n)`: the hidden states of the model's last decode's n rows."""
        self.head, self.states = head, states
        self.n_max = n_max or N_MAX
        # sequence -> (the first position of the last rows of it the model decoded,
        # their states, at most KEEP): the state that predicted its next token is there
        self.last: dict[int, tuple[int, np.ndarray]] = {}
        self.seconds = 0.0  # in the head's decodes, since load

    # ---- the draft source (runner.speculative.source) ----------------------------------

    def add(self, history: History) -> None:
        """Nothing to index: the head reads the model's rows as they are decoded."""

    def bytes(self) -> int:
        """The states kept for the next drafts (ps counts them; the head's KV is in the
        load's estimate, as a draft model's is)."""
        return sum(states.nbytes for _, states in list(self.last.values()))  # any thread

    def decoded(self, rows: Sequence[Row]) -> None:
        """The model decoded `rows` (in batch order): the head reads them too."""
        if not rows:
            return
        t0 = time.perf_counter()
        states = self.states(len(rows))
        if states is None:  # none kept (a decode of embeddings): the head reads on later
            return
        by_seq: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_seq.setdefault(row[2], []).append(i)
        catch_up: list[HeadRow] = []
        for seq, idx in by_seq.items():
            first = rows[idx[0]][1]
            before = self._state_at(seq, first - 1)
            self._clear_from(seq, first)
            for k, i in enumerate(idx):
                token, pos = rows[i][0], rows[i][1]
                catch_up.append((token, pos, seq, before if k == 0 else states[idx[k - 1]],
                                 False))
            kept = idx[-KEEP:]
            self.last[seq] = (rows[kept[0]][1], states[kept])
        self.head.decode(catch_up)
        self.seconds += time.perf_counter() - t0

    def _clear_from(self, seq: int, pos: int) -> None:
        """Make `pos` the next position of the sequence's cells: what it held there and
        after goes (rejected drafts' rows, what a cut left); and all of it where it holds
        less (a restore, a branch, an image put positions in the model the head never
        read), since most architectures' heads take a sequence's positions only in turn."""
        self.head.remove(seq, pos)
        if self.head.last(seq) < pos - 1:
            self.head.remove(seq, 0)

    def _state_at(self, seq: int, pos: int) -> np.ndarray:
        """The model's state at `pos` of `seq`, from its last decode; zeros where it is
        not there (the first token of a prompt, a prefix the slot took whole)."""
        kept = self.last.get(seq)
        if kept is not None and 0 <= pos - kept[0] < len(kept[1]):
            return kept[1][pos - kept[0]]
        return np.zeros(self.head.n_embd, dtype=np.float32)

    def propose(self, wants: Sequence[Want]) -> dict[int, list[int]]:
        """A continuation for each wanting sequence (the engine thread, after a step)."""
        drafts: dict[int, list[int]] = {}
        rows: list[HeadRow] = []
        for seq, history, n, pos in wants:
            kept = self.last.get(seq)
            if pos < 0:
                pos = len(history.tokens) - 1  # the next token's, which the model reads next
            if n <= 0 or kept is None or not 0 <= pos - 1 - kept[0] < len(kept[1]):
                continue
            self._clear_from(seq, pos)
            drafts[seq] = []
            rows.append((history.tokens[-1], pos, seq, kept[1][pos - 1 - kept[0]], True))
        if not rows:
            return {}
        t0 = time.perf_counter()
        want = {w.seq: min(w.n, self.n_max) for w in wants}
        start = {row[2]: row[1] for row in rows}
        while rows and self.head.decode(rows):
            rows = self._next(rows, drafts, want)
        for seq, pos in start.items():
            self.head.remove(seq, pos)  # the model's next decode writes these positions
        self.seconds += time.perf_counter() - t0
        return {seq: d for seq, d in drafts.items() if d}

    def _next(self, rows: list[HeadRow], drafts: dict[int, list[int]],
              want: dict[int, int]) -> list[HeadRow]:
        """Each row's pick, kept where the head is sure; the rows of the next draft step."""
        out = []
        for i, (_, pos, seq, _, _) in enumerate(rows):
            token, p, state = self.head.pick(i)
            if p < P_MIN:
                continue
            drafts[seq].append(token)
            if len(drafts[seq]) < want[seq]:
                out.append((token, pos + 1, seq, state, True))
        return out

    def set_threads(self, n: int) -> None:
        self.head.set_threads(n)

    def free(self) -> None:
        self.head.free()


class StatesOf(Protocol):
    def __call__(self, n_rows: int) -> np.ndarray | None: ...
