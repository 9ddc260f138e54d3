"""One sequence's KV state as bytes: out of a context, into one, and between contexts.

The prompt cache (runner.cache.promptcache), branching a shared prefix between slots
(runner.engine.placer) and elastic KV's move to a new context (runner.kv.growth) all go
through `llama_state_seq_get_data`/`set_data`: bit-exact KV, so greedy output is what
computing the tokens again would give.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import llama_cpp as L

from corral.runner.llama import native
from corral.runner.prefix import KVBytes


def get(ctx: Any, seq: int) -> KVBytes | None:
    """The sequence's state; None when llama.cpp gives nothing. llama.cpp writes it
    straight into the object returned (a bytearray, never changed after): a long
    prompt's state is tens of megabytes, and a second buffer and copy of it cost the
    engine thread, which every stream waits for, milliseconds at each slot handover."""
    size = L.llama_state_seq_get_size(ctx, seq)
    if size <= 0:
        return None
    state = bytearray(size)
    view = (ctypes.c_uint8 * size).from_buffer(state)
    n = L.llama_state_seq_get_data(ctx, view, size, seq)
    del view  # the export ends, so the bytearray may be cut to what was written
    if n <= 0:
        return None
    if n < size:
        del state[n:]
    return state


def get_partial(ctx: Any, seq: int) -> KVBytes | None:
    """The part of the sequence's state that no cut can reach (a recurrent memory's, a
    window cache's: LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): a checkpoint (runner.engine.plan
    Mark)."""
    flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    size = L.llama_state_seq_get_size_ext(ctx, seq, flags)
    if size <= 0:
        return None
    state = bytearray(size)
    view = (ctypes.c_uint8 * size).from_buffer(state)
    n = L.llama_state_seq_get_data_ext(ctx, view, size, seq, flags)
    del view
    return state[:n] if 0 < n else None


def put_partial(ctx: Any, state: KVBytes, seq: int) -> bool:
    """A checkpoint back into the sequence it was read from (get_partial)."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer(bytearray(state))
    return L.llama_state_seq_set_data_ext(ctx, buf, len(state), seq,
                                          L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) > 0


def put(ctx: Any, state: KVBytes, seq: int, streams: int) -> bool:
    """Load a state (from a context of any stream count) into `seq` of a context of
    `streams` KV streams; False when it does not parse or llama.cpp refuses it."""
    # A state with this context's stream count goes in as it is, as restream would give
    # it back: its parse, a walk over every cell and layer in Python, would cost a
    # restore a few tenths of a millisecond for nothing. A layout restream does not know
    # (a recurrent memory's state after the KV's) goes in as it is too: llama.cpp reads
    # it where the stream counts agree, and refuses it where they do not.
    data = state
    if len(state) < 12 or int.from_bytes(state[8:12], "little") != streams:
        ext = native.mrope(L.llama_get_model(ctx))  # its cells carry 2-D positions
        data = restream(state, streams, seq, ext) or state
    # llama.cpp only reads the buffer: point it at the state itself, not at a copy.
    if isinstance(data, bytearray):
        buf: Any = (ctypes.c_uint8 * len(data)).from_buffer(data)
    else:
        buf = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
    return L.llama_state_seq_set_data(ctx, buf, len(data), seq) > 0


def copy_sequence(src: Any, src_seq: int, dst: Any, dst_seq: int, streams: int) -> bool:
    """One sequence's KV cells from one context to another (of `streams` streams), bit
    for bit."""
    state = get(src, src_seq)
    return state is not None and put(dst, state, dst_seq, streams)


def restream(state: KVBytes, streams: int, seq: int, ext: bool = False) -> KVBytes | None:
    """A sequence's state, written by a context of some number of KV streams, as one of
    `streams` streams would take it for sequence `seq`; None if it does not parse.

    llama.cpp refuses a state whose stream count differs from its own ("n_stream
    mismatch"), though a single sequence only ever fills one stream's entry: the others
    are empty counts, and restoring puts the cells in the destination sequence's own
    stream whichever entry they came in. The layout (llama.cpp as pinned): a header
    [tag u32][sequence u32], then per memory section (one, or two for a sliding-window
    model) [n_stream u32] and per stream [cell_count u32] and, for the stream with
    cells, its cells (position, sequence ids; with `ext`, an M-RoPE model's, each cell's
    column, row and token too: llama_kv_cell_ext) and its K and V rows. The rows are
    skipped by the sizes the section itself records, and the parse must end exactly at
    the end, so a layout this does not know is refused rather than misread."""
    if len(state) < 8:
        return None
    view = memoryview(state)
    parts: list[KVBytes | memoryview] = [state[:4], seq.to_bytes(4, "little")]
    same, at = True, 8
    try:
        while at < len(state):
            n_stream = _u32(state, at)
            at += 4
            entry: memoryview | None = None
            for _ in range(n_stream):
                start, cells = at, _u32(state, at)
                at += 4
                if cells:
                    if entry is not None:
                        return None  # two streams with cells: not one sequence's state
                    at = _skip_cells(state, at, cells, ext)
                    entry = view[start:at]
            same = same and n_stream == streams
            parts += [streams.to_bytes(4, "little"), *([entry] if entry is not None else []),
                      b"\0\0\0\0" * (streams - (1 if entry is not None else 0))]
    except (IndexError, ValueError):
        return None
    if at != len(state):
        return None
    # As many streams as this context: it goes in as it is, with no copy. A host restore
    # reads neither the header's sequence nor which entry holds the cells (each goes to
    # the destination sequence's own stream), so a prefix branched between slots of one
    # context, or a cache entry from a context of the same size, needs no rewrite.
    return state if same else b"".join(parts)


def _u32(data: KVBytes, at: int) -> int:
    if at + 4 > len(data):
        raise IndexError("state ends early")
    return int.from_bytes(data[at:at + 4], "little")


def _skip_cells(state: KVBytes, at: int, cells: int, ext: bool = False) -> int:
    """Past one stream's cells: (pos, n_seq_id, [ext], the ids) each, then
    v_trans, n_layer, each layer's K rows, each layer's V rows (or V elements)."""
    # Each cell is (pos i32, n_seq u32, with `ext` x, y and token i32s, the ids). A single
    # sequence's cells have one id each, 12 bytes (24 with ext): read them in one pass;
    # the first cell that differs (so, the first misread) sends the whole walk to the
    # cell-by-cell reading.
    extra, form = (12, "<iI12xI") if ext else (0, "<iII")
    size = 12 + extra
    block = state[at:at + size * cells]
    if len(block) == size * cells and all(n == 1 for _, n, _ in struct.iter_unpack(form, block)):
        at += size * cells
    else:
        for _ in range(cells):
            n_seq = _u32(state, at + 4)
            if n_seq > 1:
                raise ValueError("a cell shared by sequences: not a single sequence's state")
            at += 8 + extra + 4 * n_seq
    v_trans, n_layer = _u32(state, at), _u32(state, at + 4)
    at += 8
    for _ in range(n_layer):  # K: type i32, row size u64, rows
        at += 12 + cells * int.from_bytes(state[at + 4:at + 12], "little")
    for _ in range(n_layer):
        if v_trans:  # type i32, element size u32, n_embd u32, elements
            at += 12 + cells * _u32(state, at + 4) * _u32(state, at + 8)
        else:  # type i32, row size u64, rows
            at += 12 + cells * int.from_bytes(state[at + 4:at + 12], "little")
    if at > len(state):
        raise IndexError("state ends early")
    return at
