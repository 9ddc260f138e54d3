"""A prompt's tokens from an earlier prompt's, where the new one begins as it did: the
tokenizer reads only what follows.

llama.cpp tokenizes a prompt whole, on every request: it splits the text at the texts
of special tokens (llama_vocab::impl::tokenizer_st_partition), then tokenizes each
piece of plain text by itself. A chat's next turn, a regenerate, an edit or a coding
agent's next request sends the same long text again with a new end; 1,600 tokens took
4-7 ms to tokenize here, a 30,000-token agent conversation about 80 ms (llama-server
pays it too, each time).

Since the pieces of plain text are tokenized alone, the tokens up to a special token
are the same in any text that is byte for byte the same up to its end, unless the new
text has a special token's text across that point (it would be matched there instead)
or the special token strips the whitespace after it (RSTRIP). So the last prompts'
tokens are kept, each with the byte offsets after its special tokens (found from the
tokens' own bytes, where those spell the text exactly); a new prompt takes the longest
prefix it shares with one of them, up to such an offset, and tokenizes only the rest.
The result is the tokens llama_tokenize gives for the whole text
(tests/test_prompt_tokens.py compares them on both starters' vocabularies).

Only for SPM and BPE vocabularies (llama.cpp's "llama" and "gpt2" tokenizer models)
that add no token at the end: their plain pieces are tokenized alone (an SPM piece
after a special token gets the same space prefix as a first piece). A special token
whose text ends in whitespace is no cut where another strips the whitespace before it
(LSTRIP): that strip could reach into its text.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import llama_cpp as L

from corral.runner.llama import native

KEEP = 8  # prompts kept; a conversation's next request begins as its last one did
MIN_BYTES = 256  # shorter prompts are tokenized whole: the lookup would cost as much
SPECIAL = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED \
    | L.LLAMA_TOKEN_ATTR_UNKNOWN  # what tokenizer_st_partition splits at
SPACE = b" \t\n\v\f\r"  # C's isspace, which llama.cpp's strips use

Tokenize = Callable[[bytes, bool], list[int]]  # (text, add_special) -> tokens


@dataclass
class _Prompt:
    text: bytes
    tokens: list[int]
    bos: bool
    cuts: list[tuple[int, int]] | None = field(default=None)  # (byte offset, tokens)


class Specials:
    """The vocabulary's special tokens, as tokenizer_st_partition reads them: found on
    first use (a pass over every id: a tenth of a second for a 262k vocabulary)."""

    def __init__(self, vocab: Any) -> None:
        self.attrs: dict[int, int] = {}
        self.by_length: dict[int, set[bytes]] = {}
        for token in range(L.llama_vocab_n_tokens(vocab)):
            attr = int(L.llama_vocab_get_attr(vocab, token))
            if attr & SPECIAL:
                self.attrs[token] = attr
                text = L.llama_vocab_get_text(vocab, token) or b""
                if text:
                    self.by_length.setdefault(len(text), set()).add(text)
        # A special token that strips the whitespace before it (LSTRIP) may strip into
        # an earlier one's text, where that ends in whitespace (Gemma's runs of newlines
        # are special tokens): after such a text, no cut, in a vocabulary that has one.
        self.lstrip = any(attr & L.LLAMA_TOKEN_ATTR_LSTRIP for attr in self.attrs.values())

    def across(self, text: bytes, cut: int) -> bool:
        """Whether a special token's text in `text` starts before `cut` and ends after it."""
        for length, texts in self.by_length.items():
            for start in range(max(0, cut - length + 1), cut):
                if text[start:start + length] in texts:
                    return True
        return False


class PromptTokens:
    """llama_tokenize with parse_special, from an earlier prompt's tokens where it can;
    from any thread."""

    def __init__(self, vocab: Any, tokenizer_model: str,
                 tokenize: Tokenize | None = None) -> None:
        self.vocab = vocab
        self._tokenize = tokenize or (lambda text, add: native.tokenize(vocab, text, add))
        self.enabled = tokenizer_model in ("llama", "gpt2") and int(L.llama_vocab_type(vocab)) \
            in (L.LLAMA_VOCAB_TYPE_SPM, L.LLAMA_VOCAB_TYPE_BPE) \
            and not L.llama_vocab_get_add_eos(vocab) and not L.llama_vocab_get_add_sep(vocab)
        self._lock = threading.Lock()
        # By text and BOS: a regenerate keeps one entry, not another copy of it.
        self._kept: OrderedDict[tuple[bool, bytes], _Prompt] = OrderedDict()
        self._specials: Specials | None = None
        self._pieces: dict[int, bytes] = {}
        self.reused = 0  # tokens taken from kept prompts, since load (tests, benchmarks)
        self._added = len(self._tokenize(b"", True)) if self.enabled else 0  # BOS or none

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        if not self.enabled or len(data) < MIN_BYTES:
            return self._tokenize(data, add_bos)
        with self._lock:
            base = self._base(data, add_bos)
        cuts = base[0].cuts[:base[1] + 1] if base is not None and base[0].cuts else []
        cut, count = cuts[-1] if cuts else (0, 0)
        head = base[0].tokens[:count] if base is not None else []
        tail = self._tokenize(data[cut:], add_bos and not count)
        prompt = _Prompt(data, head + tail, add_bos)
        with self._lock:
            if count:  # the kept cuts, and the tail's own: no pass over the whole prompt
                prompt.cuts = cuts + self._walk(data, tail, cut, count)
            self._kept[add_bos, data] = prompt
            self._kept.move_to_end((add_bos, data))
            while len(self._kept) > KEEP:
                self._kept.popitem(last=False)
            self.reused += count
        return prompt.tokens

    def _base(self, data: bytes, bos: bool) -> tuple[_Prompt, int] | None:
        """The kept prompt sharing the longest start with `data`, and the index of its
        cut to tokenize from."""
        best: tuple[_Prompt, int] | None = None
        furthest = 0
        for prompt in reversed(self._kept.values()):
            if prompt.bos != bos or prompt.text[:1] != data[:1]:
                continue
            cuts = self._cuts(prompt)
            at = bisect_right(cuts, (_shared(prompt.text, data), len(prompt.tokens) + 1)) - 1
            while at >= 0 and not self._holds(prompt, cuts[at], data):
                at -= 1
            if at >= 0 and cuts[at][0] > furthest:
                best, furthest = (prompt, at), cuts[at][0]
        return best

    def _holds(self, prompt: _Prompt, cut: tuple[int, int], data: bytes) -> bool:
        """Whether `data` splits at `cut` as the kept prompt did."""
        offset, count = cut
        assert self._specials is not None  # made by _cuts
        attr = self._specials.attrs[prompt.tokens[count - 1]]
        if attr & L.LLAMA_TOKEN_ATTR_RSTRIP and data[offset:offset + 1] in _SPACES:
            return False
        return not self._specials.across(data, offset)

    def _cuts(self, prompt: _Prompt) -> list[tuple[int, int]]:
        """(byte offset, tokens before it) after each of the prompt's special tokens, once
        its tokens' bytes have spelled its text exactly; none where they do not (an SPM
        space prefix, a stripped space, an unknown token's text)."""
        if prompt.cuts is None:
            added = self._added if prompt.bos else 0  # the BOS, which spells no text
            prompt.cuts = self._walk(prompt.text, prompt.tokens[added:], 0, added)
        return prompt.cuts

    def _walk(self, text: bytes, tokens: list[int], offset: int, count: int
              ) -> list[tuple[int, int]]:
        """The cuts after the special tokens of `tokens`, which spell `text` from `offset`
        on and follow `count` tokens; none where they do not spell it exactly."""
        if self._specials is None:
            self._specials = Specials(self.vocab)
        attrs, lstrip, cuts = self._specials.attrs, self._specials.lstrip, []
        for token in tokens:
            piece = self._piece(token)
            if text[offset:offset + len(piece)] != piece:
                return []
            offset, count = offset + len(piece), count + 1
            if token in attrs and not (lstrip and piece[-1:] in _SPACES):
                cuts.append((offset, count))
        return cuts if offset == len(text) else []

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = native.token_bytes(self.vocab, token, special=True)
        return piece


_SPACES = {bytes([c]) for c in SPACE}


def _shared(a: bytes, b: bytes) -> int:
    """The length of the longest common start of `a` and `b`: whole chunks compared as
    slices (a memcmp each), then a binary search in the first that differs."""
    lo, end, step = 0, min(len(a), len(b)), 4096
    while lo + step <= end and a[lo:lo + step] == b[lo:lo + step]:
        lo += step
    hi = min(lo + step, end)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
