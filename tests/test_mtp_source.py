"""The MTP head as a draft source (runner.speculative.mtp), on a head that records its
rows: pure, no llama.cpp. Each token goes into the head with the model's state at the
position before it; drafts start at the position the model reads the next token at
(not its token count: an M-RoPE image or a context shift moves it); and the head's
cells take a sequence's positions in turn, as most architectures' heads require."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from corral.runner.speculative.mtp import KEEP, HeadRow, MtpHead
from corral.runner.speculative.source import History, Want


class RecordingHead:
    """Proposes each token's successor, sure; refuses a position out of turn."""

    n_embd = 2

    def __init__(self) -> None:
        self.cells: dict[int, int] = {}  # sequence -> its last position (-1: none)
        self.rows: list[HeadRow] = []
        self._last: list[HeadRow] = []

    def remove(self, seq: int, start: int) -> None:
        if self.cells.get(seq, -1) >= start:
            self.cells[seq] = start - 1

    def last(self, seq: int) -> int:
        return self.cells.get(seq, -1)

    def decode(self, rows: Sequence[HeadRow]) -> bool:
        for token, pos, seq, state, logits in rows:
            if self.last(seq) >= 0 and pos != self.last(seq) + 1:
                return False
            self.cells[seq] = pos
        self.rows += rows
        self._last = list(rows)
        return True

    def pick(self, row: int) -> tuple[int, float, np.ndarray]:
        token, pos, _, _, _ = self._last[row]
        return token + 1, 1.0, np.array([float(pos), -1.0], dtype=np.float32)

    def set_threads(self, n: int) -> None: ...

    def free(self) -> None: ...


def model_states(rows: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
    """The model's "state" at each row: its position, so a pairing is read off it."""
    return np.array([[float(pos), 0.0] for _, pos, _, _ in rows], dtype=np.float32)


Rows = list[tuple[int, int, int, bool]]


def head_and_decode(rows: Rows) -> tuple[MtpHead, RecordingHead, list[Rows]]:
    """A head that read `rows`; the model's decodes, whose last gives the states."""
    native = RecordingHead()
    decoded = [rows]
    mtp = MtpHead(native, lambda n: model_states(decoded[-1][:n]))
    mtp.decoded(rows)
    return mtp, native, decoded


def test_each_token_goes_in_with_the_state_before_it() -> None:
    prompt = [(100 + p, p, 0, p == 9) for p in range(10)]
    mtp, native, _ = head_and_decode(prompt)
    assert [(r[0], r[1]) for r in native.rows] == [(100 + p, p) for p in range(10)]
    assert [r[3][0] for r in native.rows] == [0.0] + [float(p) for p in range(9)]
    assert not any(r[4] for r in native.rows)  # a catch-up wants no logits


def test_a_draft_starts_where_the_model_reads_the_next_token() -> None:
    """Twelve tokens, of which an M-RoPE image took two positions less: the next token
    is read at position 10, after the state at 9, whatever the token count says."""
    prompt = [(100 + p, p, 0, p == 9) for p in range(10)]
    mtp, native, _ = head_and_decode(prompt)
    history = History(list(range(11)) + [555])  # the sampled token is 555
    native.rows.clear()
    drafts = mtp.propose([Want(0, history, 3, pos=10)])
    assert drafts == {0: [556, 557, 558]}
    first = native.rows[0]
    assert (first[0], first[1], first[3][0], first[4]) == (555, 10, 9.0, True)
    assert [r[1] for r in native.rows] == [10, 11, 12]
    assert native.last(0) == 9  # the drafted cells went: the model writes them next


def test_a_sequence_whose_cells_have_a_gap_starts_over() -> None:
    """The model took positions the head never read (a restore, a branch): the next rows
    go into an empty sequence rather than out of turn."""
    mtp, native, decoded = head_and_decode([(100 + p, p, 0, p == 9) for p in range(10)])
    restored = [(200 + p, p, 0, p == 24) for p in range(20, 25)]
    decoded.append(restored)
    mtp.decoded(restored)
    assert native.last(0) == 24 and [r[1] for r in native.rows[-5:]] == list(range(20, 25))
    assert native.rows[-5][3][0] == 0.0  # no state before a restore: zeros


def test_only_the_last_rows_states_are_kept() -> None:
    prompt = [(1, p, 0, p == 499) for p in range(500)]
    mtp, _, _ = head_and_decode(prompt)
    first, states = mtp.last[0]
    assert first == 500 - KEEP and len(states) == KEEP
    assert mtp.bytes() == states.nbytes
