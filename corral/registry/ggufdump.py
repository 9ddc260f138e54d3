"""Everything in a GGUF header, values and all, for `show --verbose`.

`registry.gguf` keeps only what the request path needs and skips array values;
this reads them too, on the same bounded Reader (every count and length checked
before it is used), plus each tensor's name, type and shape. A verbose show is
rare, so it reads the file anew rather than holding a vocabulary in memory.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from corral.errors import InvalidModelFile
from corral.registry.gguf import MAGIC, MAX_ARRAY, MAX_DIMS, SUPPORTED_VERSIONS, _read_value, gguf
from corral.registry.ggufio import ARRAY, SCALAR, STRING, Reader, open_regular


def dump_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metadata with full values, tensors as {name, type, shape})."""
    with open_regular(path) as f:
        r = Reader(f, os.fstat(f.fileno()).st_size)
        if r.take(4, "magic") != MAGIC or r.u32("header") not in SUPPORTED_VERSIONS:
            raise InvalidModelFile("invalid model file: bad header")
        n_tensors, n_kv = r.u64("header"), r.u64("header")
        if n_kv > r.remaining // 14 or n_tensors > r.remaining // 33:
            raise InvalidModelFile("invalid model file: too many entries")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            metadata[key] = _value(r, r.u32(key), key)
        return metadata, [_tensor(r) for _ in range(n_tensors)]


def _value(r: Reader, type_id: int, key: str) -> Any:
    if type_id != ARRAY:  # scalars and strings exactly as the inspector reads them
        return _read_value(r, type_id, key)
    item_type, count = r.u32(key), r.u64(key)
    if count > MAX_ARRAY or count > r.remaining:
        raise InvalidModelFile(f"invalid model file: array too long in {key[:80]}")
    if item_type == STRING:
        return [r.string(key, strict=False) for _ in range(count)]
    if item_type not in SCALAR:
        raise InvalidModelFile(f"invalid model file: unknown array type {item_type}")
    fmt = SCALAR[item_type]
    data = r.take(count * struct.calcsize(fmt), key)
    return list(struct.unpack(f"<{count}{fmt[1]}", data))


def _tensor(r: Reader) -> dict[str, Any]:
    name = r.string("tensor name")
    n_dims = r.u32("tensor info")
    if n_dims == 0 or n_dims > MAX_DIMS:
        raise InvalidModelFile("invalid model file: bad tensor dimensions")
    shape = [r.u64("tensor info") for _ in range(n_dims)]
    type_id = r.u32("tensor info")
    r.u64("tensor info")  # offset
    try:
        type_name = gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        type_name = str(type_id)
    return {"name": name, "type": type_name, "shape": shape}

