"""Drafts from what came before: an n-gram index across every sequence the engine saw.

Much of what a local model writes repeats its context: a file again with a change, a
record filled from a document, a quote. When the last K tokens of a sequence came
before (in its own prompt or output, in another slot's, or in an earlier request's),
the tokens that followed them then are a draft: the engine verifies it in one decode,
and each token the sampler would have picked anyway costs almost nothing
(runner.engine; the policy of how many to draft is runner.speculative.policy).

llama.cpp's `ngram-simple` searches the sequence's own history backwards and its
`ngram-mod` keeps a hash of long n-grams per server; this index keeps, for each K-gram,
where it last continued, in whichever sequence: one dictionary lookup per draft, and
sixteen requests over one document draft from each other.
"""

from __future__ import annotations

from itertools import repeat, takewhile
from typing import Sequence

from corral.runner.speculative.source import History, Row, Want

# Tokens that must match before a draft is made. Short keys draft sooner after an edit
# (a renamed variable, an inserted type hint) and are wrong more often; the policy
# stops a slot whose drafts keep failing, so a miss costs little.
K = 6
# K-grams kept before the index starts over (llama.cpp's ngram-mod resets its table
# past a quarter full, for the same reason: old text stops predicting new text). Each
# costs about a hundred bytes.
LIMIT = 1 << 18
# Tokens indexed before it starts over, whatever the keys: an entry holds its sequence's
# whole history, so requests over one long document with short questions would keep
# every one of them alive (about 40 bytes a token).
TOKENS = 1 << 21
KEY_BYTES, TOKEN_BYTES = 100, 40  # what each costs in the interpreter, as measured
PROMPT = 32  # tokens added at once past which the keys are built in C loops


class NgramIndex:
    """K-gram -> (history, the position that followed it there), the latest wins. A
    draft source (runner.speculative.source) whose drafts cost a lookup each."""

    priced = False

    def __init__(self, k: int = K, limit: int = LIMIT, tokens: int = TOKENS) -> None:
        self.k, self.limit, self.tokens = k, limit, tokens
        self._next: dict[int, tuple[History, int]] = {}
        self._held = 0  # tokens indexed since it last started over

    def __len__(self) -> int:
        return len(self._next)

    def bytes(self) -> int:
        """About what the index holds now (ps counts it beside the prompt cache); at most
        LIMIT keys and TOKENS tokens' worth (runner.fitestimate.NGRAM_INDEX_BYTES)."""
        return len(self._next) * KEY_BYTES + self._held * TOKEN_BYTES

    def add(self, history: History) -> None:
        """Index the K-grams of `history` whose continuation is known now (each ends before
        a token that came after it), from where the last call stopped."""
        tokens, k, n = history.tokens, self.k, len(history.tokens)
        self._held += n - history.indexed
        start = max(history.indexed, k)
        if n - start > PROMPT and min(tokens[start - k:n - 1]) >= 0:
            # A prompt of text in C loops: it is indexed on the engine thread, after the
            # step that read it and before the next drafts (30k tokens took 17 ms in
            # Python). A decoded token goes through the plain loop below, which is
            # cheaper for one.
            keys = zip(*(tokens[start - k + j:n - k + j] for j in range(k)))
            self._next.update(zip(map(hash, keys), zip(repeat(history), range(start, n))))
        else:
            for i in range(start, n):
                key = tokens[i - k:i]
                if min(key) >= 0:  # an image's placeholders predict nothing
                    self._next[hash(tuple(key))] = (history, i)
        history.indexed = n
        if len(self._next) > self.limit or self._held > self.tokens:
            self._next.clear()  # sequences still running index on from here
            self._held = 0

    def draft(self, history: History, n: int) -> list[int]:
        """Up to `n` tokens that followed the last K tokens of `history` where they came
        before; [] when they never came, or `n` is 0.

        Where that continuation runs out (it reached the end of what its sequence holds
        so far), the last K tokens of the draft are looked up in turn, as llama.cpp's
        ngram-mod does token by token: a sequence caught in a loop, whose latest
        occurrence of its key is one period back, then drafts the loop again and again
        instead of one period per step."""
        tokens, k = history.tokens, self.k
        if n <= 0 or len(tokens) < k:
            return []
        draft: list[int] = []
        key = tokens[-k:]
        while len(draft) < n:
            hit = self._next.get(hash(tuple(key)))
            if hit is None:
                break
            source, at = hit
            # A hash can collide: the key is checked where it points, so a draft is
            # never built on a match that is not one.
            if source.tokens[at - k:at] != key:
                break
            more = list(takewhile(lambda t: t >= 0, source.tokens[at:at + n - len(draft)]))
            if not more:
                break
            draft += more
            key = (key + more)[-k:]
        return draft

    def decoded(self, rows: Sequence[Row]) -> None:
        """Nothing: `add` hears the tokens."""

    def propose(self, wants: Sequence[Want]) -> dict[int, list[int]]:
        return {w.seq: self.draft(w.history, w.n) for w in wants}

    def set_threads(self, n: int) -> None:
        """Nothing decodes here."""

    def free(self) -> None:
        """Python memory only."""
