"""Whether a draft pays for its rows, learned from the engine's own decode steps.

Every row of a batch that asks for logits costs about the same, and a verified draft is
such a row whether it is kept or not. What a row saves is a token's share of a step.
On a CPU one stream's step is mostly reading the weights, so a row costs a small part
of it and a draft pays when a quarter of it is kept; four streams' step is already
mostly arithmetic, so a row costs nearly what the token it may save does, and only a
draft that is nearly always kept pays (a model with a large vocabulary, whose output
layer is most of a row, sooner). The fit below says which, on this machine and model,
from steps that decoded only (time = base + rows x row, least squares over recent
steps), and each sequence's acceptance rate, which starts from the runner's own, says
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


@dataclass
class RowCost:
    rate: float = 0.5  # the runner's acceptance rate (a moving average)
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A step that decoded `rows` rows, each with logits, in `seconds`."""
        self._w = self._w * DECAY + 1.0
        self._x = self._x * DECAY + rows
        self._y = self._y * DECAY + seconds
        self._xx = self._xx * DECAY + rows * rows
        self._xy = self._xy * DECAY + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(base, per row) seconds of a step; None until steps of different sizes came."""
        spread = self._w * self._xx - self._x * self._x
        if spread <= 1e-9 * max(self._w * self._xx, 1.0):
            return None
        row = (self._w * self._xy - self._x * self._y) / spread
        base = (self._y - row * self._x) / self._w
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
        """A sequence's acceptance rate: its own, from the runner's at first."""
        return (policy.accepted + PRIOR * self.rate) / (policy.drafted + PRIOR)

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rate += 0.1 * (accepted / drafted - self.rate)
