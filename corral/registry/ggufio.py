"""Bounded reading of a GGUF file's bytes: every length checked before it is used.

`Reader` never reads past the file's size or allocates more than a length cap,
and reads token arrays a block at a time; `open_regular` refuses anything that
is not a regular file without blocking on it.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import struct
import sys
from types import ModuleType
from typing import BinaryIO

from corral.errors import InvalidModelFile

MAX_STRING = 16 << 20
BLOCK = 1 << 20
_U64 = struct.Struct("<Q")

# GGUF value type ids.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
INTEGER = {U8, I8, U16, I16, U32, I32, U64, I64}


def gguf_constants() -> ModuleType:
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


class Reader:
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
        fmt = SCALAR[type_id]
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

    def skip_strings(self, count: int, what: str, keep: frozenset[bytes] = frozenset(),
                     into: list[bytes] | None = None) -> frozenset[bytes]:
        """Skip `count` length-prefixed strings, reading whole blocks, and give those
        of them that are in `keep` (every one, in order, appended to `into` if given).

        A 262k-token vocabulary would otherwise cost two file calls per token;
        the same length and end-of-file checks apply to every string.
        """
        base, block, i = self.pos, b"", 0  # block starts at file offset `base`
        unpack = _U64.unpack_from
        longest = max((len(k) for k in keep), default=-1) if into is None else MAX_STRING
        found = set()
        for _ in range(count):
            if i + 8 > len(block):
                base += i
                block, i = self._block_at(base, what), 0
            n = unpack(block, i)[0]
            if n > MAX_STRING:
                raise InvalidModelFile(f"invalid model file: string too long in {what}")
            if n <= longest:
                if i + 8 + n > len(block):  # the text runs past this block
                    base += i
                    block, i = self._block_at(base, what), 0
                text = block[i + 8:i + 8 + n]
                if into is not None:
                    if len(text) != n:  # longer than a block: no vocabulary's token is
                        raise InvalidModelFile(f"invalid model file: string too long in {what}")
                    into.append(text)
                elif text in keep:
                    found.add(text)
            i += 8 + n
        end = base + i
        if end > self.size:
            raise InvalidModelFile(f"invalid model file: truncated in {what}")
        self.f.seek(end)
        self.pos = end
        return frozenset(found)

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


