"""How many tokens a slot drafts at each step: what its drafts earned, and what the batch
can spare.

A verified draft costs a batch row per token whether it is accepted or not. On a CPU a
row of a batch costs a small share of a decode of one token, so a long draft that is
accepted is nearly free and one that fails at its first token costs its rows for
nothing. So:

- A slot starts at START tokens. A draft accepted whole doubles its next one, up to
  MAX; a draft cut short makes the next one at most the accepted run and two more (the
  text has turned: the next draft is likely cut there again), and at least MIN.
- A draft of which nothing is accepted is a miss. After each miss in a row the slot
  waits twice as many steps before it drafts again (1, 2, 4, ... up to MAX_WAIT): free
  text, where the index keeps offering phrases that do not come again, soon stops
  paying for rows at all, and a stretch of copying later is still found. A model (a
  draft model, an MTP head) still proposes a token every few steps of the wait,
  unverified, and a right one ends it: its proposals follow the text as it turns.
- A busy batch drafts less: the decoding slots share ROWS draft rows per step, at most
  ROWS // decoding each (at one stream a slot may draft 32; at sixteen, 2). Rows that
  verify one slot's guesses would otherwise crowd out the tokens other streams are
  sure to keep.
- A step carries the draft rows that give it the most tokens a second, as this
  machine's own steps price a step of each row count (runner.speculative.cost), the
  seconds they add counted twice for the streams that wait through them with no draft
  of their own: the sequences likeliest to keep them first, cut where the rows that
  pay end; a new sequence is judged by the runner's rate until it has its own. Where
  every slot has a KV stream of its own, the decoding slots of a step draft as many
  tokens each.
  Speculation (runner.speculative.speculation) applies these rules, once a step for
  each decoding sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

START = 8
MAX = 32
MIN = 2
MAX_WAIT = 64
ROWS = 32


@dataclass
class DraftPolicy:
    """One sequence's drafting state (it moves with the sequence between slots)."""

    length: int = START
    misses: int = 0  # drafts in a row of which nothing was accepted
    wait: int = 0  # steps to go before the next draft
    drafted: int = 0  # tokens drafted and verified, over the sequence's life
    accepted: int = 0
    # Drafts made but not verified (a step of per-slot streams that drafted none): how
    # many, and how many of them had the token the sequence then sampled first.
    foreseen: int = 0
    foreseen_right: int = 0

    def want(self, decoding: int, room: int) -> int:
        """Tokens to draft this step: 0 while waiting after misses; else the policy's
        length within the batch's share (`decoding` slots decode this step) and `room`
        (what the sequence may still generate, less the token it decodes anyway)."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return max(0, min(self.length, ROWS // max(decoding, 1), room))

    def foresaw(self, right: bool) -> None:
        """A draft made and not verified: whether its first token was the one sampled. A
        right one ends a wait after misses (a model's proposals are made while it waits:
        the text it foresees has come)."""
        self.foreseen += 1
        self.foreseen_right += right
        if right:
            self.wait = self.misses = 0

    def counting(self, drafted: int) -> None:
        """A draft of `drafted` tokens goes to verification: they count now, since
        sampling them may end the sequence, whose final counts are read then."""
        self.drafted += drafted

    def kept(self) -> None:
        """One token of the draft being verified was kept (counted as it is)."""
        self.accepted += 1

    def verified(self, drafted: int, accepted: int, counted: bool = False) -> None:
        """A draft of `drafted` tokens was verified and `accepted` of them kept (`counted`:
        `counting` and `kept` have told the counts already; the length adapts here)."""
        if drafted <= 0:
            return
        if not counted:
            self.drafted += drafted
            self.accepted += accepted
        if accepted == drafted:
            self.length = min(self.length * 2, MAX)
        else:
            self.length = max(MIN, min(self.length, accepted + 2))
        if accepted == 0:
            self.misses += 1
            self.wait = min(1 << (self.misses - 1), MAX_WAIT)
        else:
            self.misses = 0
