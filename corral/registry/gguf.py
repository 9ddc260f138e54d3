"""A bounded GGUF header reader that rejects malformed files before llama.cpp sees them.

Every count and length is checked against a fixed cap and against the bytes
that remain, before anything is allocated; known keys must have their expected
types; every tensor must lie inside the file. Any failure is InvalidModelFile.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from corral.errors import InvalidModelFile
from corral.registry.fim import WANTED, fim_roles
from corral.registry.ggufio import (
    ARRAY,
    BOOL,
    F32,
    I32,
    INTEGER,
    SCALAR,
    STRING,
    U32,
    Reader,
    gguf_constants,
    open_regular,
)

gguf = gguf_constants()


MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_ARRAY = 64 << 20
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 20
DEFAULT_ALIGNMENT = 32
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8
INT64_MAX = (1 << 63) - 1

# Expected types for keys we rely on, by suffix (the prefix is the architecture).
_INTSCALAR_SUFFIXES = (
    ".block_count", ".context_length", ".embedding_length", ".attention.key_length",
    ".attention.value_length", ".attention.sliding_window", ".file_type",
    ".bos_token_id", ".eos_token_id", ".pooling_type",
)
_INT_OR_INT_ARRAY_SUFFIXES = (".attention.head_count", ".attention.head_count_kv",
                              ".feed_forward_length")
_ARRAY_TYPES = {"tokenizer.ggml.tokens": STRING, "tokenizer.ggml.scores": F32,
                "tokenizer.ggml.token_type": I32, "tokenizer.ggml.merges": STRING}
_STRING_KEYS = {"general.architecture", "general.name", "tokenizer.chat_template",
                "tokenizer.ggml.model"}


@dataclass
class GGUFInfo:
    version: int
    architecture: str
    parameter_count: int
    file_type: int | None
    quantization: str
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    key_length: int | None
    value_length: int | None
    sliding_window: int | None
    chat_template: str | None
    tensor_bytes: dict[str, int]
    data_offset: int
    file_size: int
    metadata: dict[str, object] = field(default_factory=dict)
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ggml order
    fim: frozenset[str] = frozenset()  # fill-in-the-middle roles (registry/fim.py)
    # Small integer and boolean arrays (per-layer values: a hybrid's head_count_kv, whose
    # zeros are its recurrent layers), which `metadata` leaves out.
    arrays: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def layer_bytes(self) -> dict[int, int]:
        """Weight bytes per block index (`blk.N.*`), for the GPU offload estimate."""
        out: dict[int, int] = {}
        for name, size in self.tensor_bytes.items():
            parts = name.split(".")
            if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
                out[int(parts[1])] = out.get(int(parts[1]), 0) + size
        return out


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Inspect a GGUF file on disk; every problem, including a bad path, is InvalidModelFile."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        return read_gguf(f, size)


def read_gguf(f: BinaryIO, size: int) -> GGUFInfo:
    r, version, n_tensors, n_kv = _header(f, size)
    metadata = _read_metadata(r, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    assert isinstance(alignment, int)
    if alignment <= 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
        raise InvalidModelFile("invalid model file: bad alignment")
    tensors = _read_tensor_infos(r, n_tensors, alignment)
    data_offset = -(-r.pos // alignment) * alignment
    if data_offset > size:
        raise InvalidModelFile("invalid model file: truncated before tensor data")
    _check_tensor_extents(tensors, data_offset, size)
    return _summarize(version, metadata, tensors, data_offset, size)


@dataclass(frozen=True)
class Vocabulary:
    """What decides whether two models' tokens are the same tokens (registry/draft.py)."""

    model: object  # tokenizer.ggml.model: "gpt2", "llama", ...
    tokens: list[bytes]
    bos: object
    eos: object
    add_bos: object
    add_eos: object


def read_vocabulary(path: str | os.PathLike[str]) -> Vocabulary:
    """A GGUF's vocabulary, every token text in order (the metadata only)."""
    with open_regular(path) as f:
        r, _, _, n_kv = _header(f, os.fstat(f.fileno()).st_size)
        metadata = _read_metadata(r, n_kv, vocabulary=True)
    tokens = metadata.get("tokenizer.ggml.tokens")
    items = tokens.items if isinstance(tokens, _Array) else None
    return Vocabulary(metadata.get("tokenizer.ggml.model"), items or [],
                      metadata.get("tokenizer.ggml.bos_token_id"),
                      metadata.get("tokenizer.ggml.eos_token_id"),
                      metadata.get("tokenizer.ggml.add_bos_token"),
                      metadata.get("tokenizer.ggml.add_eos_token"))


def _header(f: BinaryIO, size: int) -> tuple[Reader, int, int, int]:
    """The reader, past the header; the version; the tensor and metadata counts."""
    r = Reader(f, size)
    if size < 4 or r.take(4, "magic") != MAGIC:
        raise InvalidModelFile("invalid model file: bad magic")
    version = r.u32("header")
    if version not in SUPPORTED_VERSIONS:
        raise InvalidModelFile(f"invalid model file: unsupported GGUF version {version}")
    n_tensors = r.u64("header")
    n_kv = r.u64("header")
    if n_kv > r.remaining // MIN_KV_BYTES:
        raise InvalidModelFile("invalid model file: too many metadata entries")
    if n_tensors > r.remaining // MIN_TENSOR_BYTES:
        raise InvalidModelFile("invalid model file: too many tensors")
    return r, version, n_tensors, n_kv


def _read_metadata(r: Reader, n_kv: int, vocabulary: bool = False) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = r.string("metadata key")
        if key in metadata:
            raise InvalidModelFile(f"invalid model file: duplicate key {key[:80]!r}")
        type_id = r.u32("metadata type")
        value = _read_value(r, type_id, key, vocabulary)
        _check_known_key(key, type_id, value)
        metadata[key] = value
    return metadata


class _Array:
    """An array value, kept only as its element type and length (plus small int arrays)."""

    def __init__(self, item_type: int, count: int, ints: list[int] | None,
                 texts: frozenset[bytes] = frozenset(),
                 items: list[bytes] | None = None) -> None:
        self.item_type = item_type
        self.count = count
        self.ints = ints
        self.texts = texts  # the strings asked for by name (the FIM token texts)
        self.items = items  # every string, where the whole vocabulary was asked for

    def __repr__(self) -> str:
        return f"<array of {self.count}>"


def _read_value(r: Reader, type_id: int, key: str, vocabulary: bool = False) -> object:
    if type_id in SCALAR:
        return r.scalar(type_id, key)
    if type_id == STRING:
        return r.string(key, strict=False)
    if type_id != ARRAY:
        raise InvalidModelFile(f"invalid model file: unknown value type {type_id}")
    item_type = r.u32(key)
    count = r.u64(key)
    if item_type == ARRAY:
        raise InvalidModelFile("invalid model file: nested arrays")
    if item_type == STRING:
        if count > MAX_ARRAY or count > r.remaining // 8:
            raise InvalidModelFile(f"invalid model file: array too long in {key[:80]}")
        # The vocabulary's FIM-looking token texts are kept: llama.cpp finds FIM tokens
        # by their text where the metadata names none (registry/fim.py).
        tokens = key == "tokenizer.ggml.tokens"
        items: list[bytes] | None = [] if tokens and vocabulary else None
        texts = r.skip_strings(count, key, WANTED if tokens else frozenset(), items)
        return _Array(item_type, count, None, texts, items)
    if item_type not in SCALAR:
        raise InvalidModelFile(f"invalid model file: unknown array type {item_type}")
    width = struct.calcsize(SCALAR[item_type])
    if count > MAX_ARRAY or count > r.remaining // width:
        raise InvalidModelFile(f"invalid model file: array too long in {key[:80]}")
    if (item_type in INTEGER or item_type == BOOL) and count <= 4096:  # per-layer values
        data = r.take(count * width, key)
        ints = [int(v) for v in struct.unpack(f"<{count}{SCALAR[item_type][1]}", data)]
        return _Array(item_type, count, ints)
    r.skip(count * width, key)
    return _Array(item_type, count, None)


def _check_known_key(key: str, type_id: int, value: object) -> None:
    bad = False
    if key == "general.alignment":
        bad = type_id != U32
    elif key in _STRING_KEYS:
        bad = type_id != STRING
    elif key in _ARRAY_TYPES:
        bad = not (isinstance(value, _Array) and value.item_type == _ARRAY_TYPES[key])
    elif key.endswith(_INTSCALAR_SUFFIXES):
        bad = type_id not in INTEGER
    elif key.endswith(_INT_OR_INT_ARRAY_SUFFIXES):
        bad = type_id not in INTEGER and not (
            isinstance(value, _Array) and value.item_type in INTEGER
        )
    if bad:
        raise InvalidModelFile(f"invalid model file: wrong type for {key[:80]!r}")


@dataclass
class _Tensor:
    name: str
    offset: int
    nbytes: int
    n_elements: int
    shape: tuple[int, ...] = ()


def _read_tensor_infos(r: Reader, n_tensors: int, alignment: int) -> list[_Tensor]:
    tensors: list[_Tensor] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        name = r.string("tensor name")
        if name in seen:
            raise InvalidModelFile(f"invalid model file: duplicate tensor {name[:80]!r}")
        seen.add(name)
        n_dims = r.u32("tensor info")
        if n_dims == 0 or n_dims > MAX_DIMS:
            raise InvalidModelFile("invalid model file: bad tensor dimensions")
        dims = [r.u64("tensor info") for _ in range(n_dims)]
        type_id = r.u32("tensor info")
        offset = r.u64("tensor info")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise InvalidModelFile(f"invalid model file: unknown tensor type {type_id}") from None
        n_elements = 1
        for d in dims:
            if d == 0 or d > INT64_MAX:
                raise InvalidModelFile("invalid model file: bad tensor dimensions")
            n_elements *= d
            if n_elements > INT64_MAX:
                raise InvalidModelFile("invalid model file: tensor too large")
        if dims[0] % block:
            raise InvalidModelFile("invalid model file: tensor row not a whole number of blocks")
        if offset % alignment:
            raise InvalidModelFile("invalid model file: unaligned tensor offset")
        tensors.append(_Tensor(name, offset, n_elements // block * type_size, n_elements,
                               tuple(dims)))
    return tensors


def _check_tensor_extents(tensors: list[_Tensor], data_offset: int, size: int) -> None:
    end_of_previous = 0
    for t in sorted(tensors, key=lambda t: t.offset):
        if data_offset + t.offset + t.nbytes > size:
            raise InvalidModelFile(f"invalid model file: tensor {t.name[:80]!r} past end of file")
        if t.offset < end_of_previous:
            raise InvalidModelFile("invalid model file: overlapping tensors")
        end_of_previous = t.offset + t.nbytes


def _int_meta(metadata: dict[str, object], key: str) -> int | None:
    value = metadata.get(key)
    if isinstance(value, _Array):
        return max(value.ints) if value.ints else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _quant_name(file_type: int | None) -> str:
    if file_type is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return "unknown"
    for prefix in ("MOSTLY_", "ALL_"):
        name = name.removeprefix(prefix)
    return name


def _summarize(version: int, metadata: dict[str, object], tensors: list[_Tensor],
               data_offset: int, size: int) -> GGUFInfo:
    arch = metadata.get("general.architecture")
    arch = arch if isinstance(arch, str) else "unknown"
    template = metadata.get("tokenizer.chat_template")
    file_type = _int_meta(metadata, "general.file_type")

    def key(suffix: str) -> int | None:
        return _int_meta(metadata, f"{arch}.{suffix}")

    plain = {k: v for k, v in metadata.items()
             if not isinstance(v, _Array) and not (isinstance(v, str) and len(v) > 1024)}
    return GGUFInfo(
        version=version,
        architecture=arch,
        parameter_count=sum(t.n_elements for t in tensors),
        file_type=file_type,
        quantization=_quant_name(file_type),
        context_length=key("context_length"),
        block_count=key("block_count"),
        embedding_length=key("embedding_length"),
        head_count=key("attention.head_count"),
        head_count_kv=key("attention.head_count_kv"),
        key_length=key("attention.key_length"),
        value_length=key("attention.value_length"),
        sliding_window=key("attention.sliding_window"),
        chat_template=template if isinstance(template, str) else None,
        tensor_bytes={t.name: t.nbytes for t in tensors},
        data_offset=data_offset,
        file_size=size,
        metadata=plain,
        arrays={k: tuple(v.ints) for k, v in metadata.items()
                if isinstance(v, _Array) and v.ints is not None},
        tensor_shapes={t.name: t.shape for t in tensors},
        fim=_fim(metadata),
    )


def _fim(metadata: dict[str, object]) -> frozenset[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, _Array):
        return frozenset()
    texts = frozenset(t.decode() for t in tokens.texts)
    return fim_roles(metadata, texts, tokens.count)


def human_parameter_count(n: int) -> str:
    """Ollama's `model_type`: 8.0B, 268.10M, 567K."""
    if n >= 1_000_000_000:
        v = n / 1e9
        return f"{v:.0f}B" if v == int(v) else f"{v:.1f}B"
    if n >= 1_000_000:
        v = n / 1e6
        return f"{v:.0f}M" if v == int(v) else f"{v:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.0f}K"
    return str(n)

