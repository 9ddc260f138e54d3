"""Builders for tiny valid GGUF files and hand-made malformed ones."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

U32, I32, F32, STRING, ARRAY = 4, 5, 6, 8, 9
F32_TENSOR = 0


def write_tiny_gguf(path: Path, arch: str = "llama", padding: int = 0) -> Path:
    """A small but well-formed GGUF written by the gguf package itself; `padding` float32s
    of seeded random weights in one more tensor make it as big as a test needs."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a", "b", "c"])
    w.add_token_scores([0.0, 1.0, 2.0, 3.0])
    w.add_chat_template("{{ messages }}")
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), dtype=np.float32))
    if padding:
        w.add_tensor("blk.0.ffn_up.weight", np.random.default_rng(7).random(
            (padding // 1024, 1024), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, type_id: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", type_id) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def tensor(name: str, dims: list[int], type_id: int = F32_TENSOR, offset: int = 0) -> bytes:
    out = s(name) + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    return out + struct.pack("<I", type_id) + struct.pack("<Q", offset)


def build(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None, alignment: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<I", version)
    head += struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors)
    head += struct.pack("<Q", len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % alignment)
    return body + data


def valid_handmade() -> bytes:
    """One f32 tensor of 8 elements, 32 bytes of data."""
    return build([kv("general.architecture", STRING, s("llama"))],
                 [tensor("t", [8])], data=b"\0" * 32)
