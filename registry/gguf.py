"""A bounded GGUF header reader that rejects malformed files before llama.cpp sees them.

Every count and length is checked against a fixed cap and against the bytes
that remain, before anything is allocated; known keys must have their expected
types; every tensor must lie inside the file. Any failure is InvalidModelFile.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import struct
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import BinaryIO

from corral.errors import InvalidModelFile


def _gguf_constants() -> ModuleType:
    """gguf's constant tables, without the package's __init__.

    Importing `gguf` loads numpy and its readers and writers, a fifth of a
    second on every daemon and runner start; constants.py needs only the stdlib.
    A later `import gguf` finds this same module registered as gguf.constants.
    """
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    spec = importlib.util.find_spec("gguf")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(list(spec.submodule_search_locations)[0], "constants.py")
    const_spec = importlib.util.spec_from_file_location("gguf.constants", path)
    assert const_spec is not None and const_spec.loader is not None
    module = importlib.util.module_from_spec(const_spec)
    sys.modules["gguf.constants"] = module
    const_spec.loader.exec_module(module)
    return module


gguf = _gguf_constants()

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_STRING = 16 << 20
MAX_ARRAY = 64 << 20
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 20
DEFAULT_ALIGNMENT = 32
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8
INT64_MAX = (1 << 63) - 1
BLOCK = 1 << 20
_U64 = struct.Struct("<Q")

# GGUF value type ids.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
_INTEGER = {U8, I8, U16, I16, U32, I32, U64, I64}

# Expected types for keys we rely on, by suffix (the prefix is the architecture).
_INT_SCALAR_SUFFIXES = (
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

    def layer_bytes(self) -> dict[int, int]:
        """Weight bytes per block index (`blk.N.*`), for the GPU offload estimate."""
        out: dict[int, int] = {}
        for name, size in self.tensor_bytes.items():
            parts = name.split(".")
            if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
                out[int(parts[1])] = out.get(int(parts[1]), 0) + size
        return out


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.remaining:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        data = self.f.read(n)
        if len(data) != n:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.remaining:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def scalar(self, type_id: int, what: str) -> int | float | bool:
        fmt = _SCALAR[type_id]
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(U32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(U64, what))

    def string_len(self, what: str) -> int:
        n = self.u64(what)
        if n > MAX_STRING or n > self.remaining:
            raise InvalidModelFile(f"invalid model file: string too long in {what}")
        return n

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` length-prefixed strings, reading whole blocks.

        A 262k-token vocabulary would otherwise cost two file calls per token;
        the same length and end-of-file checks apply to every string.
        """
        base, block, i = self.pos, b"", 0  # block starts at file offset `base`
        unpack = _U64.unpack_from
        for _ in range(count):
            if i + 8 > len(block):
                base += i
                block, i = self._block_at(base, what), 0
            n = unpack(block, i)[0]
            if n > MAX_STRING:
                raise InvalidModelFile(f"invalid model file: string too long in {what}")
            i += 8 + n
        end = base + i
        if end > self.size:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        self.f.seek(end)
        self.pos = end

    def _block_at(self, offset: int, what: str) -> bytes:
        if offset + 8 > self.size:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        self.f.seek(offset)
        return self.f.read(min(BLOCK, self.size - offset))

    def string(self, what: str, strict: bool = True) -> str:
        raw = self.take(self.string_len(what), what)
        try:
            return raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError:
            raise InvalidModelFile(f"invalid model file: bad UTF-8 in {what}") from None


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a path only if it is a regular file, never blocking on FIFOs or devices."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError:
        raise InvalidModelFile(f"{os.fspath(path)}: invalid model file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidModelFile(f"{os.fspath(path)}: invalid model file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Inspect a GGUF file on disk; every problem, including a bad path, is InvalidModelFile."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        return read_gguf(f, size)


def read_gguf(f: BinaryIO, size: int) -> GGUFInfo:
    r = _Reader(f, size)
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


def _read_metadata(r: _Reader, n_kv: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = r.string("metadata key")
        if key in metadata:
            raise InvalidModelFile(f"invalid model file: duplicate key {key[:80]!r}")
        type_id = r.u32("metadata type")
        value = _read_value(r, type_id, key)
        _check_known_key(key, type_id, value)
        metadata[key] = value
    return metadata


class _Array:
    """An array value, kept only as its element type and length (plus small int arrays)."""

    def __init__(self, item_type: int, count: int, ints: list[int] | None) -> None:
        self.item_type = item_type
        self.count = count
        self.ints = ints

    def __repr__(self) -> str:
        return f"<array of {self.count}>"


def _read_value(r: _Reader, type_id: int, key: str) -> object:
    if type_id in _SCALAR:
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
        r.skip_strings(count, key)
        return _Array(item_type, count, None)
    if item_type not in _SCALAR:
        raise InvalidModelFile(f"invalid model file: unknown array type {item_type}")
    width = struct.calcsize(_SCALAR[item_type])
    if count > MAX_ARRAY or count > r.remaining // width:
        raise InvalidModelFile(f"invalid model file: array too long in {key[:80]}")
    if item_type in _INTEGER and count <= 4096:
        data = r.take(count * width, key)
        ints = [int(v) for v in struct.unpack(f"<{count}{_SCALAR[item_type][1]}", data)]
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
    elif key.endswith(_INT_SCALAR_SUFFIXES):
        bad = type_id not in _INTEGER
    elif key.endswith(_INT_OR_INT_ARRAY_SUFFIXES):
        bad = type_id not in _INTEGER and not (
            isinstance(value, _Array) and value.item_type in _INTEGER
        )
    if bad:
        raise InvalidModelFile(f"invalid model file: wrong type for {key[:80]!r}")


@dataclass
class _Tensor:
    name: str
    offset: int
    nbytes: int
    n_elements: int


def _read_tensor_infos(r: _Reader, n_tensors: int, alignment: int) -> list[_Tensor]:
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
        tensors.append(_Tensor(name, offset, n_elements // block * type_size, n_elements))
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
    )


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

