"""Speculative decoding's one owner, as llama.cpp's common_speculative is one object.

It holds where drafts come from (a draft source: the n-gram index, a draft model, or the
model's own MTP head; runner.speculative.source), the drafts made, what a row costs on
this machine (runner.speculative.cost) and the rules of each sequence's policy
(runner.speculative.policy; a sequence carries its own policy's state, which moves with
it when it is preempted). The engine talks to it at four points of a step:

- after the model's decode (`decoded`): the source hears the rows it read (an MTP head
  reads them too, with the model's hidden states);

- after a step (`prepare`): the decision what each decoding sequence drafts at the next
  step is made here, once, with every constraint together (its policy, what it may
  still generate, the rows the batch leaves it, llama.cpp's split_equal of per-slot
  streams, whether its drafts pay for their rows), and the source makes them then, in
  one call for all of them (looked up in the index, or proposed by a model in one
  batch of its own);
- schedule (`drafts`): takes the drafts made for sequences that are still where they
  were (same tokens), and plans them as rows;
- postprocess (`counting`, `kept`, `verified`, `extended`): hears what was drafted and
  kept, which the policy and the cost learn from, and each sampled token.
"""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple, Sequence

from corral.runner.speculative.cost import Offer, StepCost, passes
from corral.runner.speculative.ngram import NgramIndex
from corral.runner.speculative.source import DraftSource, History, Row, Want
from corral.runner.speculative.policy import DraftPolicy


FORESEE = 4  # a sequence waiting after misses hears a priced source every this many steps


class Candidate(NamedTuple):
    """A sequence that decodes at the next step (runner.engine.schedule lists them)."""

    seq_id: int
    policy: DraftPolicy
    history: History
    room: int  # what it may still generate, less the token it decodes anyway
    pos: int = -1  # the position its next token is read at (Want.pos)


class Ask(NamedTuple):
    """What the next step can take: its decoding sequences, and how it lays them out."""

    candidates: list[Candidate]
    n_batch: int
    # A KV stream per slot: llama.cpp splits the batch into ubatches of as many rows of
    # each sequence (split_equal), so every decoding slot drafts as many (batchplan).
    split_equal: bool


class Speculation:
    def __init__(self, source: DraftSource | None = None, cost: StepCost | None = None,
                 undo: int | None = None) -> None:
        """`source`: where drafts come from, the n-gram index by default (a Modelfile's
        DRAFT model, the model's MTP head; a test's). `undo`: the most tokens the model's memory can
        take back, where it is recurrent (runner.llama.context); a draft is never
        longer, and since llama.cpp splits every batch of such a memory into ubatches of
        as many rows of each sequence, its decoding sequences draft as many tokens each,
        as per-slot streams do."""
        self.undo = undo
        # (not `or`: an empty index has no length, and is falsy)
        self.source: DraftSource = source if source is not None else NgramIndex()
        self.cost = cost or StepCost()
        self._made: dict[int, tuple[History, int, list[int]]] = {}  # seq -> what it drafts
        # id(history) -> (its length then, a draft's first token, its policy): drafts
        # made and not verified, scored by the next token (StepCost.expects)
        self._unverified: dict[int, tuple[int, int, DraftPolicy]] = {}
        self._split_equal = False  # at the last step's layout: the passes it took (cost.passes)
        # id(history) -> the sequences whose new tokens the source has yet to hear: told
        # before the next drafts are made, not before the first token goes out (`started`)
        self._unheard: dict[int, History] = {}

    # ---- after a step: the next step's drafts -------------------------------------------

    def prepare(self, ask: Ask | None) -> None:
        """After every step: the source hears the tokens sequences were given since the
        last (`started`, `extended`); then, where the next step decodes (`ask`), decide
        what each candidate drafts there, and make those drafts."""
        for history in self._unheard.values():
            self.source.add(history)
        self._unheard.clear()
        if ask is None:
            return
        self._made.clear()
        self._unverified.clear()
        equal = self._split_equal = ask.split_equal or self.undo is not None
        decided, foresee = self._decide(ask, equal)
        wants = [Want(seq, c.history, n, c.pos) for seq, (c, n) in decided.items()]
        made = self.source.propose(wants + [Want(c.seq_id, c.history, 1, c.pos)
                                            for c in foresee])
        used = (self._equal if equal else self._cut)(
            ask.candidates, {seq: made[seq] for seq in decided if seq in made})
        for c in ask.candidates:
            tokens, history = made.get(c.seq_id), c.history
            if tokens and used.get(c.seq_id):
                self._made[c.seq_id] = (history, len(history.tokens), used[c.seq_id])
            elif tokens:  # made, not verified: its first token is scored by the next one
                self._unverified[id(history)] = (len(history.tokens), tokens[0], c.policy)

    def _decide(self, ask: Ask, equal: bool
                ) -> tuple[dict[int, tuple[Candidate, int]], list[Candidate]]:
        """How many tokens each candidate drafts: as many as its policy asks (a step of
        its wait counts here, once a step), within its room and the rows the batch leaves
        each. The n-gram index's drafts cost a lookup, so they are made whole and cut
        after (`_cut`, `_equal`). A priced source's cost a row of its batch each, so a
        candidate whose draft would not pay for its rows gets one token (and where
        `equal` sequences must all pay and some do not, every one gets one): a draft made
        and not verified still tells its odds by the next token, so a sequence whose
        first drafts missed, or that a busy moment priced out, is seen to be copying
        once it is, and drafts again. So is one waiting after misses: every FORESEE
        steps of its wait (a proposal costs a row of the source's decode), a priced source
        (a model, sure of what it proposes or silent) is asked for one token it does not
        verify (`foresee`), and a right one ends the wait (DraftPolicy.foresaw)."""
        cands = ask.candidates
        spare = (ask.n_batch - len(cands)) // max(len(cands), 1)
        look = not self.source.priced
        out = {}
        if self.undo is not None:
            spare = min(spare, self.undo)
        foresee = []
        for c in cands:
            waiting = c.policy.wait > 0
            n = min(c.policy.want(len(cands), c.room), spare)
            if n > 0:
                out[c.seq_id] = (c, n if look or self._pays(c.policy, len(cands), n) else 1)
            elif waiting and not look and c.room > 0 and c.policy.wait % FORESEE == 0:
                foresee.append(c)
        if equal and not look and any(
                not self._pays(c.policy, len(cands), n) for c, n in out.values()):
            return {seq: (c, 1) for seq, (c, _) in out.items()}, foresee
        return out, foresee

    def _cut(self, cands: list[Candidate], made: dict[int, list[int]]
             ) -> dict[int, list[int]]:
        """In one shared KV buffer each stream drafts its own length: the step takes the
        draft rows that give it the most tokens a second (StepCost.best), the tokens of
        the sequences likeliest to keep them first, each draft cut where the rows end."""
        odds = sorted(((self.cost.expects(c.policy), c.seq_id) for c in cands
                       if made.get(c.seq_id)), reverse=True)
        offers = [Offer(1, p, rank) for rank, (p, seq) in enumerate(odds, 1)
                  for _ in made[seq]]
        left = self.cost.best(len(cands), offers)
        used = {}
        for _, seq in odds:
            if left <= 0:
                break
            used[seq], left = made[seq][:left], left - len(made[seq])
        return used

    def _equal(self, cands: list[Candidate], made: dict[int, list[int]]
              ) -> dict[int, list[int]]:
        """Where every slot has a KV stream of its own: every decoding slot drafts as
        many tokens, as many as pay, or none unless every one has a draft.

        llama.cpp splits such a batch into ubatches of as many rows of each sequence
        (cost.passes), each a pass over the weights, so drafts of different lengths cost
        passes; and streams that advance together stay together, where drafting some
        lets them run ahead and leaves the rest to a slower tail. Measured on four copies
        at once (benchmarks/spec.py's workload, six runs each): choosing each step's
        layout by a fitted line instead (drafts cut to each length, in as many passes,
        or filled up to it with guesses, in one) gave 126-142 tok/s, this 147-151."""
        if not cands or any(not made.get(c.seq_id) for c in cands):
            return {}
        least = min(len(made[c.seq_id]) for c in cands)
        kept = sum(self.cost.expects(c.policy) for c in cands)
        k = self.cost.best(len(cands), [Offer(len(cands), kept, len(cands))] * least)
        return {c.seq_id: made[c.seq_id][:k] for c in cands} if k else {}

    def _pays(self, policy: DraftPolicy, decoding: int, length: int) -> bool:
        """Whether a sequence's draft of `length` tokens would pay for its rows alone.
        Each drafts once before the odds decide: its own text may be a copy where the
        runner's last requests were not."""
        return not policy.drafted or self.cost.best(
            decoding, [Offer(1, self.cost.expects(policy), 1)] * length) > 0

    # ---- schedule ------------------------------------------------------------------------

    def drafts(self, histories: dict[int, History]) -> dict[int, list[int]]:
        """The drafts made for the sequences decoding now (seq id -> its tokens), each only
        while it holds the tokens it was made for."""
        return {seq: tokens for seq, (history, length, tokens) in self._made.items()
                if histories.get(seq) is history and len(history.tokens) == length}

    # ---- postprocess ---------------------------------------------------------------------

    def started(self, history: History) -> None:
        """A new sequence's prompt: what it most likely quotes. The source hears it with
        the next drafts (`prepare`, after the step that reads it has sampled): a prompt's
        first token does not wait for it (the n-gram index of a 30k-token prompt, 17 ms)."""
        self._unheard[id(history)] = history

    def extended(self, history: History, token: int) -> None:
        guess = self._unverified.pop(id(history), None)
        if guess is not None and guess[0] == len(history.tokens):
            guess[2].foresaw(token == guess[1])
        history.tokens.append(token)
        self._unheard[id(history)] = history

    @staticmethod
    def counting(policy: DraftPolicy, drafted: int) -> None:
        """A draft goes to verification: every drafted token counts, as llama-server's
        draft_n does, now (a kept one's sample may end the sequence and send its counts)."""
        policy.counting(drafted)

    @staticmethod
    def kept(policy: DraftPolicy) -> None:
        policy.kept()

    def verified(self, policy: DraftPolicy, drafted: int, accepted: int) -> None:
        """A draft's verdict: its policy adapts, and the cost prices the rows paid
        against the tokens kept."""
        policy.verified(drafted, accepted, counted=True)
        self.cost.verified(drafted, accepted)

    def observe(self, seq_ids: list[int], seconds: float) -> None:
        """A decode-only step whose rows (each with logits) were of `seq_ids`, in batch
        order, took `seconds`; where every slot has a KV stream of its own it took as
        many passes as split_equal makes of them."""
        runs = [(seq, len(list(group))) for seq, group in groupby(seq_ids)]
        self.cost.observe(len(seq_ids), seconds, passes(runs) if self._split_equal else 1)

    # ---- the engine ----------------------------------------------------------------------

    def decoded(self, rows: Sequence[Row]) -> None:
        """The model's decode read `rows` (its MTP head reads them too)."""
        self.source.decoded(rows)

    def bytes(self) -> int:
        """What the source holds for its drafts (ps counts it): the n-gram index's."""
        return self.source.bytes()

    def set_threads(self, n: int) -> None:
        self.source.set_threads(n)

    def free(self) -> None:
        self.source.free()


def speculation(on: bool, source: DraftSource | None = None, undo: int | None = None,
                cost: StepCost | None = None) -> Speculation | None:
    """Speculative decoding for an engine, its drafts from `source` (a Modelfile's DRAFT
    model, the model's MTP head, each of which proposes after each step on the engine
    thread; a test's), else from the n-gram index, each at most `undo` tokens where that
    is set (a recurrent memory's, with llama.cpp's snapshots, n_rs_seq), its draft rows
    priced by `cost` (a test's prices; else by the steps' own seconds, which follow the
    machine's speed); None where it is off, and then a source loaded for nothing is
    freed."""
    if on:
        return Speculation(source, cost, undo)
    if source is not None:
        source.free()
    return None
