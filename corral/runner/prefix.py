"""What the prompt cache and the engine's KV moves share, below both: how many leading
tokens two prompts share, and a sequence's KV as the bytes llama.cpp writes.

Pure, so the prompt cache (runner.cache) is used and tested without llama.cpp, and
the KV moves (runner.kv.kvbytes) name the bytes they make without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq, Union

# A sequence's KV as bytes: what llama.cpp wrote (runner.kv.kvbytes: a bytearray, written in
# place and never changed after) or what was read back from disk (bytes).
KVBytes = Union[bytes, bytearray]
# A sequence's checkpoints, where its memory cannot be cut back (Cuts): (tokens, the part
# of its state no cut reaches, read after them: a recurrent state, a sliding window's KV),
# oldest first (runner.engine.plan Mark)
Checkpoints = tuple[tuple[int, KVBytes], ...]



@dataclass(frozen=True)
class Cuts:
    """Where a sequence's memory can be cut back, for a prompt that keeps fewer of its
    tokens: at any position while it holds fewer than `below` tokens, else only back at
    a checkpoint (runner.engine.plan Rewind) or where nothing goes. `below` None: always
    (attention, every position's KV kept); 0: never (a recurrent state has no positions);
    a sliding window's size, for a window cache of that size (runner.llama.context),
    which overwrites the KV of positions that left every query's window."""

    below: int | None = None
    checkpoints: int = 0  # how many a slot keeps where it cannot be cut (runner.engine.plan Mark)
    # The last few tokens of a sequence's last decode can be taken back (a rejected
    # draft's; a prompt's last one, for its state one token short: runner.engine.schedule
    # Schedule._retakes): everywhere but a recurrent memory without llama.cpp's snapshots
    # of them (n_rs_seq 0: speculation off).
    takeback: bool = True

    def anywhere(self, held: int) -> bool:
        return self.below is None or held < self.below

    def recent(self, held: int, n: int, since: int = 0) -> bool:
        """A cut to `n` of a live sequence of `held` tokens that a window cache usually
        still makes: within a window of its end, whose KV stays until the cache's ring
        comes round to it, and not before the window of a state copied in at `since`
        (llama.cpp copies only the cells its end's window sees: Slot.window_from). Tried,
        and checked when made (runner.llama.partial)."""
        window = self.below or 0
        return window > 0 and held - n < window and max(n - window, 0) >= since


PREFIX_CHUNK = 64  # tokens compared at once as slices by common_prefix


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading tokens a and b share. The engine thread asks this of every slot
    and cache entry at each placement, over prompts of thousands of tokens: whole chunks
    are compared as slices (in C) and only the chunk that differs is walked in Python."""
    if type(a) is not type(b):  # a tuple's slice never equals a list's
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    i = 0
    while i + PREFIX_CHUNK <= n and a[i:i + PREFIX_CHUNK] == b[i:i + PREFIX_CHUNK]:
        i += PREFIX_CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i
