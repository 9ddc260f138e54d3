"""Whether draft rows pay, from what the engine's own decode steps cost by their rows.

Every row of a batch that asks for logits costs something, and a verified draft is such
a row whether it is kept or not; what a kept row saves is a token's share of a step. So
a step should carry the draft rows that give the most tokens a second: its decoding
streams' tokens plus what the drafts are expected to keep, over what a step of that
many rows costs.

What a step of so many rows costs is not a line. On the CPU, ggml's repacked weights
(the AVX2 and AVX-512 kernels for Q4_K and friends) multiply four rows at a time, and
read the weights once more for each row left over: measured on the base starter with
two threads (llama_decode, one unified KV), 16 rows took 84 ms, 17 took 99, 18 took 104,
20 took 100, 24 took 120 and 32 took 144; 15 rows cost more than 16. Under a line fitted
through such steps a draft of two rows beside sixteen streams looked nearly free and
made the step a quarter dearer (speculation then cost 9-12% of throughput at c=16). So
the cost is kept as it was seen: a moving mean of the seconds of decode-only steps of
each row count (a GPU's nearly flat curve and a CPU's steps alike), between seen counts
the line through the nearest two. A count above the largest seen is priced as the
largest, so tried once (trying is how its price becomes known), where every decoding
stream drafts in it; where some would wait through it with no draft of their own, it is
priced by the line through the smallest and the largest seen, carried on, and tried only
where that says it pays: on a GPU's flat curve, but not beside sixteen streams on a
CPU's, where priced as the largest every new count was tried, and again as each was
forgotten, at every stream's expense. A count not seen for STALE steps is forgotten, and
so tried again: a moment of load does not price a layout out for good.

Each sequence's acceptance rate, which starts from the runner's own, says how much of
a draft it may expect to keep.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import NamedTuple

from corral.runner.speculative.policy import DraftPolicy

ALPHA = 0.2  # weight of a new step in its row count's mean
STALE = 256  # decode steps after which a row count's mean is forgotten
PRIOR = 8  # drafted tokens' worth of the runner's acceptance rate a sequence starts from
# What a second that drafts add to a step costs the streams that wait through it with
# no draft of their own, over the second itself: they take no token from it, and a
# stream whose drafts land runs ahead of those it came with, so its next prompt goes in
# alone beside them, at a dearer price a row than in the wave it left. Measured on the
# base starter at c=16 (compare.py's workload, each step logged): with drafts priced at
# their seconds alone, 8-12% of the steps drafted, 80-92% of the drafts were kept, the
# steps that carried them cost 20-35% more, the prompts 1.2 s more over a 15 s run (3.4
# s against 2.2), and throughput fell 5-15% against speculation off. At twice the
# seconds for the waiting share, a draft of a few streams beside sixteen on that CPU's
# curve never pays; four streams that all copy (benchmarks/spec.py) draft as before, as
# does one alone; on a GPU's flat curve the rows cost little either way.
BESIDE = 1.0


class Offer(NamedTuple):
    """Draft rows a step may take (StepCost.best): how many, the tokens they are expected
    to keep, and how many of the decoding streams have drafts once they are taken."""

    rows: int
    kept: float
    drafting: int


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
class StepCost:
    rate: float = 0.5  # the runner's acceptance rate (a moving average)
    # rows -> (mean seconds of a decode-only step of that many rows, the step it was
    # last seen at)
    _seconds: dict[int, tuple[float, int]] = field(default_factory=dict)
    _steps: int = 0

    def observe(self, rows: int, seconds: float, passes: int = 1) -> None:
        """A step that decoded `rows` rows, each with logits, in `passes` ubatches, in
        `seconds`. A step split into several passes (per-slot streams with drafts of
        different lengths, which the layout never plans) is no row count's price."""
        self._steps += 1
        if passes != 1:
            return
        seen = self._seconds.get(rows)
        mean = seconds if seen is None else seen[0] + ALPHA * (seconds - seen[0])
        self._seconds[rows] = (mean, self._steps)

    def estimate(self, rows: int) -> float | None:
        """What a decode-only step of `rows` rows is expected to cost; None where no step
        of as many rows or fewer has been seen lately."""
        return _at(self._fresh(), rows)

    def best(self, decoding: int, offers: list[Offer]) -> int:
        """How many of `offers` to take, in their order, into a step where `decoding`
        streams decode: the prefix with the most tokens a second by `estimate`, the
        seconds its drafts add counted again (BESIDE) for the share of the streams that
        wait with none, the shortest of equals. All of them while no step of `decoding`
        rows has been seen: drafting is how the cost becomes known."""
        fresh = self._fresh()
        alone = _at(fresh, decoding)
        if alone is None:
            return len(offers)
        best_n, best_rate = 0, decoding / alone
        rows, tokens = decoding, float(decoding)
        for n, offer in enumerate(offers, 1):
            rows, tokens = rows + offer.rows, tokens + offer.kept
            waiting = max(decoding - offer.drafting, 0) / decoding
            cost = _at(fresh, rows, explore=offer.drafting >= decoding)
            if cost is None:
                continue
            cost += BESIDE * waiting * max(cost - alone, 0.0)
            if tokens / cost > best_rate * (1 + 1e-9):
                best_n, best_rate = n, tokens / cost
        return best_n

    def _fresh(self) -> list[tuple[int, float]]:
        """(rows, mean seconds) of the row counts seen within STALE steps, by rows."""
        return sorted((r, s) for r, (s, at) in self._seconds.items()
                      if self._steps - at < STALE)

    def expects(self, policy: DraftPolicy) -> float:
        """A sequence's acceptance rate: its own, from the runner's at first, counting
        the drafts it made but did not verify by their first token (which costs no row,
        so a sequence whose early drafts missed is seen to be copying once it is)."""
        return (policy.accepted + policy.foreseen_right + PRIOR * self.rate) / (
            policy.drafted + policy.foreseen + PRIOR)

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rate += 0.1 * (accepted / drafted - self.rate)


def _at(fresh: list[tuple[int, float]], rows: int, explore: bool = False) -> float | None:
    """The cost of `rows` by the seen counts (`StepCost._fresh`): the count's own mean,
    else the line through the nearest seen below and above, else (none seen above) the
    largest seen's where it is to be tried (`explore`), or the line through the smallest
    and the largest seen, carried on (never down), or with one count seen, that count's;
    None where none was seen at or below."""
    i = bisect_left(fresh, (rows, float("-inf")))
    if i < len(fresh) and fresh[i][0] == rows:
        return fresh[i][1]
    if i == 0:
        return None
    (r0, s0) = fresh[i - 1]
    if i == len(fresh):
        if explore:
            return s0
        (ra, sa) = fresh[0]
        slope = max(s0 - sa, 0.0) / (r0 - ra) if r0 > ra else 0.0
        return s0 + slope * (rows - r0)
    r1, s1 = fresh[i]
    return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
