"""What the prompt cache and the engine's KV moves share, below both: how many leading
tokens two prompts share, and a sequence's KV as the bytes llama.cpp writes.

Pure, so the prompt cache (runner.cache) is used and tested without llama.cpp, and
the KV moves (runner.kv.kvbytes) name the bytes they make without importing it.
"""

from __future__ import annotations

from typing import Sequence as Seq, Union

# A sequence's KV as bytes: what llama.cpp wrote (runner.kv.kvbytes: a bytearray, written in
# place and never changed after) or what was read back from disk (bytes).
KVBytes = Union[bytes, bytearray]
# A recurrent memory's checkpoints of a sequence: (tokens, the recurrent state read after
# them), oldest first (runner.engine.plan Mark)
Checkpoints = tuple[tuple[int, KVBytes], ...]

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
