"""Whether a draft pays for its rows, learned from the engine's own decode steps.

Every row of a batch that asks for logits costs about the same, and a verified draft is
such a row whether it is kept or not. What a row saves is a token's share of a step.
On a CPU one stream's step is mostly reading the weights, so a row costs a small part
of it and a draft pays when a quarter of it is kept; four streams' step is already
mostly arithmetic, so a row costs nearly what the token it may save does, and only a
draft that is nearly always kept pays (a model with a large vocabulary, whose output
layer is most of a row, sooner). The fit below says which, on this machine and model,
from steps that decoded only (time = base x passes + rows x row, least squares over
recent steps, a pass being one of the ubatches llama.cpp splits a batch into), and
each sequence's acceptance rate, which starts from the runner's own, says
how much of a draft it may expect to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.runner.speculative.policy import DraftPolicy

DECAY = 0.98  # weight of a step in the fit, per later step: the last hundred or so count
PRIOR = 8  # drafted tokens' worth of the runner's acceptance rate a sequence starts from
# The most a draft is ever asked to keep: a sequence that keeps this much of its drafts
# drafts however the fit reads (a copy is kept whole), so a fit misled by a loaded
# machine can slow copying down, never stop it.
CEILING = 0.75


def passes(runs: list[tuple[int, int]]) -> int:
    """The ubatches llama.cpp decodes a batch in where every slot has a KV stream of its
    own (split_equal, sequential): `runs` is (seq id, rows) in batch order. Each pass
    takes the first sequence with rows left and those after it with consecutive ids,
    as many rows from each as the fewest of them has left."""
    left = [[seq, n] for seq, n in runs if n > 0]
    count = 0
    while left:
        group = [left[0]]
        for run in left[1:]:
            if run[0] == group[-1][0] + 1:
                group.append(run)
        least = min(run[1] for run in group)
        for run in group:
            run[1] -= least
        left = [run for run in left if run[1] > 0]
        count += 1
    return count


@dataclass
class RowCost:
    rate: float = 0.5  # the runner's acceptance rate (a moving average)
    # decayed sums for time = base x passes + row x rows (least squares, through 0)
    _pp: float = 0.0
    _pn: float = 0.0
    _nn: float = 0.0
    _pt: float = 0.0
    _nt: float = 0.0

    def observe(self, rows: int, seconds: float, passes: int = 1) -> None:
        """A step that decoded `rows` rows, each with logits, in `passes` ubatches, in
        `seconds`."""
        d = DECAY
        self._pp = self._pp * d + passes * passes
        self._pn = self._pn * d + passes * rows
        self._nn = self._nn * d + rows * rows
        self._pt = self._pt * d + passes * seconds
        self._nt = self._nt * d + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(base, per row) seconds: a pass over the weights, and a row; None until steps
        of different shapes came."""
        det = self._pp * self._nn - self._pn * self._pn
        if det <= 1e-9 * max(self._pp * self._nn, 1.0):
            return None
        base = (self._pt * self._nn - self._nt * self._pn) / det
        row = (self._nt * self._pp - self._pt * self._pn) / det
        return (base, row) if row > 0 and base > 0 else None  # else noise, not a machine

    def needed(self, decoding: int) -> float:
        """The share of its tokens a draft must expect to keep to pay for its rows in a
        step where `decoding` slots decode: a row's cost over a token's share of the
        step, at most CEILING. 0 while the fit is unknown (drafting is how it becomes
        known)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        base, row = fit
        return min(row * decoding / (base + row * decoding), CEILING)

    def expects(self, policy: DraftPolicy) -> float:
        """A sequence's acceptance rate: its own, from the runner's at first, counting
        the drafts it made but did not verify by their first token (which costs no row,
        so a sequence whose early drafts missed is seen to be copying once it is)."""
        return (policy.accepted + policy.foreseen_right + PRIOR * self.rate) / (
            policy.drafted + policy.foreseen + PRIOR)

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rate += 0.1 * (accepted / drafted - self.rate)
