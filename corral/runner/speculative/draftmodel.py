"""Drafts from a smaller model: a Modelfile's DRAFT, loaded in the same runner process.

Where the n-gram index (runner.speculative.ngram) finds only what the context already
holds, a draft model with the model's vocabulary (registry/draft.py checked it at create
time) guesses free text too. Its context (runner.llama.draftcontext) lives beside the
model's and, like it, only the engine thread touches it: after each step, for every
decoding sequence speculation decided drafts at the next one, and as many tokens as it
decided (runner.speculative.speculation), this brings the sequence's copy there up to
date and proposes a continuation greedily, one batch for all of them per token; the
next step verifies it as it would an n-gram draft: exact, whatever the draft model
proposes.

A proposal stops at `n_max` tokens (the `draft_num_predict` option), at a token the
draft model gives less than P_MIN of its probability (llama.cpp's --draft-p-min: past
it, most drafts are rejected, and each costs a draft decode and a verification row), and
at a token the model's vocabulary lacks. Each sequence's cells in the draft context are
kept between steps and requests on its slot, so only new tokens are evaluated.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from corral.runner.fitestimate import DRAFT_STREAMS
from corral.runner.speculative.source import History, Row, Want

P_MIN = 0.75
# Rows of catching up (a new request's prompt, a restored prefix) the draft model decodes
# per step, all sequences together: a long prompt is read over several steps, like a
# prefill, so that no stream waits seconds on it; a sequence drafts once it is read.
CATCH_UP = 256
N_MAX = 16  # llama-server's --draft-max, when draft_num_predict is not given
# Sequences' worth of cells the draft context holds (allocated whole at load): at more
# streams than this, each step's drafting sequences evict the others' cells, and a busy
# batch drafts little anyway (runner.speculative.policy).
STREAMS = DRAFT_STREAMS


class Decoder(Protocol):
    """The draft model's context (runner.llama.draftcontext.DraftContext)."""

    def remove(self, seq: int, start: int) -> None: ...

    def decode(self, rows: Sequence[Row]) -> dict[int, tuple[int, float]] | None: ...

    def set_threads(self, n: int) -> None: ...

    def free(self) -> None: ...


class DraftModel:
    priced = True  # each proposed token is a row of a draft decode

    def __init__(self, context: Decoder, n_vocab: int, cells: int, n_max: int = 0,
                 n_own: int = 0) -> None:
        """`n_vocab`: the model's vocabulary size (a token past it is never proposed);
        `cells`: the draft context's; `n_own`: the draft model's own vocabulary size
        (0: the model's), which a sequence holding a token past it cannot be fed to."""
        self.context, self.n_target, self.n_max = context, n_vocab, n_max or N_MAX
        self.n_own = n_own or n_vocab
        self.cells = cells
        self.held: dict[int, list[int]] = {}  # sequence -> the tokens its cells hold
        self.seconds = 0.0  # in the draft model's decodes, since load

    # ---- the draft source (runner.speculative.source) ----------------------------------

    def add(self, history: History) -> None:
        """A sequence's new tokens: nothing to index (the draft model reads them when it
        next proposes for that sequence)."""

    def decoded(self, rows: Sequence[Row]) -> None:
        """Nothing: the draft model reads a sequence's tokens when it next proposes."""

    def bytes(self) -> int:
        """Nothing beside its context, which its load counts (runner.process.loading)."""
        return 0

    def propose(self, wants: Sequence[Want]) -> dict[int, list[int]]:
        """A continuation for each wanting sequence (the engine thread, after a step)."""
        wants = self._fitting([w._replace(n=min(w.n, self.n_max)) for w in wants
                               if w.n > 0 and self._readable(w.history.tokens)])
        if not wants:
            return {}
        t0 = time.perf_counter()
        self._make_room(wants)
        catch_up, ready = self._catch_up(wants)
        wants = [want for want in wants if want[0] in ready]
        picks = self._decode(catch_up)
        drafts: dict[int, list[int]] = {w.seq: [] for w in wants}
        while picks:
            rows: list[Row] = []
            for seq, history, n, _ in wants:
                if seq not in picks:
                    continue
                token, p = picks[seq]
                if p < P_MIN or token >= self.n_target:
                    continue
                drafts[seq].append(token)
                if len(drafts[seq]) < n:  # its logits give the next one
                    rows.append((token, len(history.tokens) + len(drafts[seq]) - 1, seq, True))
            picks = self._decode(rows)
            for token, _, seq, _ in rows if picks else []:
                self.held[seq].append(token)
        self.seconds += time.perf_counter() - t0
        return drafts

    def _readable(self, tokens: list[int]) -> bool:
        """Whether the draft model can read every token: not an image's placeholder
        (negative), nor a token past its own vocabulary (the two may differ by 128 in
        size). Such a sequence does not draft; a batch holding one would be refused whole,
        and every drafting sequence read again from its start."""
        return bool(tokens) and min(tokens) >= 0 and max(tokens) < self.n_own

    def _fitting(self, wants: list[Want]) -> list[Want]:
        """The wants whose tokens and proposals fit in the cells together, shortest
        first: a sequence longer than the draft context (past a context shift, or in a
        pool longer than its share) does not draft, rather than fail every step."""
        out, room = [], self.cells
        for want in sorted(wants, key=lambda w: len(w[1].tokens)):
            need = len(want[1].tokens) + want[2]
            if need <= room:
                out.append(want)
                room -= need
        return out

    def _make_room(self, wants: Sequence[Want]) -> None:
        """Drop the cells of sequences that do not draft now while the drafting ones'
        tokens and proposals would not fit beside them."""
        drafting = {w.seq for w in wants}
        need = sum(len(w.history.tokens) + w.n for w in wants)
        idle = [seq for seq in self.held if seq not in drafting]
        while idle and need + sum(len(t) for t in self.held.values()) > self.cells:
            seq = idle.pop()
            self.context.remove(seq, 0)
            del self.held[seq]

    def _catch_up(self, wants: Sequence[Want]) -> tuple[list[Row], set[int]]:
        """The rows that bring each sequence's cells to its tokens (past what they hold
        that it shares), the last with logits: at least that one, whose logits were not
        kept. At most CATCH_UP rows in all, shortest sequences first; the sequences read
        to their end, which propose now."""
        rows: list[Row] = []
        ready, budget = set(), CATCH_UP
        for seq, history, _, _ in wants:
            tokens, held = history.tokens, self.held.get(seq, [])
            keep = 0
            limit = min(len(held), len(tokens) - 1)
            while keep < limit and held[keep] == tokens[keep]:
                keep += 1
            self.context.remove(seq, keep)
            end = min(len(tokens), keep + budget)
            budget -= end - keep
            self.held[seq] = list(tokens[:end])
            rows += [(tokens[pos], pos, seq, pos == len(tokens) - 1) for pos in range(keep, end)]
            if end == len(tokens):
                ready.add(seq)
        return rows, ready

    def _decode(self, rows: list[Row]) -> dict[int, tuple[int, float]]:
        """The draft model's picks after `rows`; none when there are none, or when the
        decode failed (every sequence is then read again next time)."""
        if not rows:
            return {}
        picks = self.context.decode(rows)
        if picks is None:
            self.held.clear()
            return {}
        return picks

    def set_threads(self, n: int) -> None:
        self.context.set_threads(n)

    def free(self) -> None:
        self.context.free()
