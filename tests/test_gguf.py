"""The bounded GGUF reader: valid files parse, every malformed case is InvalidModelFile."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral.errors import InvalidModelFile
from corral.registry.gguf import inspect_gguf, read_gguf
from tests.gguf_files import (
    ARRAY,
    F32,
    I32,
    STRING,
    U32,
    build,
    kv,
    kv_u32,
    s,
    tensor,
    valid_handmade,
    write_tiny_gguf,
)


def parse(data: bytes):  # type: ignore[no-untyped-def]
    return read_gguf(io.BytesIO(data), len(data))


def rejects(data: bytes) -> str:
    with pytest.raises(InvalidModelFile) as info:
        parse(data)
    return info.value.message


def test_tiny_gguf_from_the_gguf_package(tmp_path: Path) -> None:
    info = inspect_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert info.architecture == "llama"
    assert info.block_count == 1 and info.context_length == 128
    assert info.embedding_length == 8 and info.head_count == 2 and info.head_count_kv == 1
    assert info.chat_template == "{{ messages }}"
    assert info.parameter_count == 4 * 8 + 8 * 8
    assert info.tensor_bytes == {"token_embd.weight": 128, "blk.0.attn_q.weight": 256}
    assert info.layer_bytes() == {0: 256}
    assert info.quantization == "F32"


def test_handmade_valid_file_parses() -> None:
    assert parse(valid_handmade()).tensor_bytes == {"t": 32}


@pytest.mark.parametrize("data", [b"", b"G", b"GGU", b"GGUF", b"GGUF\x03\x00"])
def test_empty_and_short_files(data: bytes) -> None:
    rejects(data)


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_bad_magic_and_versions(version: int) -> None:
    rejects(b"GGML" + valid_handmade()[4:])
    rejects(build([], [], version=version))


def test_huge_counts_rejected_before_allocating() -> None:
    assert "too many" in rejects(build([], [], n_kv=2**64 - 1))
    assert "too many" in rejects(build([], [], n_tensors=2**64 - 1))
    assert "too many" in rejects(build([], [], n_kv=1000))


def test_string_and_array_lengths() -> None:
    huge_string = struct.pack("<Q", 2**63) + b"x"
    rejects(build([struct.pack("<Q", 2**63) + b"k"], []))
    rejects(build([s("k") + struct.pack("<I", STRING) + huge_string], []))
    rejects(build([kv("k", STRING, struct.pack("<Q", 17 << 20) + b"x" * 10)], []))
    too_many = struct.pack("<I", U32) + struct.pack("<Q", 64 << 21)
    rejects(build([kv("k", ARRAY, too_many)], []))
    nested = struct.pack("<I", ARRAY) + struct.pack("<Q", 1)
    assert "nested" in rejects(build([kv("k", ARRAY, nested + b"\0" * 16)], []))
    rejects(build([kv("k", 99, b"\0" * 8)], []))


@pytest.mark.parametrize("entry", [
    kv("general.alignment", STRING, s("32")),
    kv("general.alignment", I32, struct.pack("<i", 32)),
    kv("llama.block_count", F32, struct.pack("<f", 1.0)),
    kv("llama.block_count", ARRAY, struct.pack("<IQ", U32, 1) + struct.pack("<I", 1)),
    kv("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", 1, 1) + b"\0"),
    kv("general.architecture", U32, struct.pack("<I", 1)),
])
def test_wrong_types_for_known_keys(entry: bytes) -> None:
    assert "wrong type" in rejects(build([entry], []))


@pytest.mark.parametrize("alignment", [0, 3, 48, 2 << 20])
def test_bad_alignment(alignment: int) -> None:
    assert "alignment" in rejects(build([kv_u32("general.alignment", alignment)], []))


@pytest.mark.parametrize("tensors,data", [
    ([tensor("t", [])], b""),
    ([tensor("t", [1, 1, 1, 1, 1])], b""),
    ([tensor("t", [0])], b""),
    ([tensor("t", [2**62, 2**62])], b""),
    ([tensor("t", [8], type_id=999)], b""),
    ([tensor("t", [8]), tensor("t", [8], offset=32)], b"\0" * 64),
    ([tensor("t", [8], offset=4)], b"\0" * 64),
    ([tensor("t", [8], offset=0)], b"\0" * 31),
    ([tensor("t", [8], offset=2**63)], b"\0" * 32),
    ([tensor("a", [16]), tensor("b", [8], offset=32)], b"\0" * 96),
    ([tensor("q", [31], type_id=2)], b"\0" * 64),
])
def test_bad_tensors(tensors: list[bytes], data: bytes) -> None:
    rejects(build([], tensors, data=data))


def test_truncation_in_every_section(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    info = parse(data)
    cuts = [10, 30, 100, 200, info.data_offset - 40, info.data_offset - 1,
            info.data_offset + 10, len(data) - 1]
    for cut in cuts:
        rejects(data[:cut])


def test_paths_that_are_not_regular_files(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, Path("/dev/null"), Path("/dev/zero"), tmp_path / "missing"):
        with pytest.raises(InvalidModelFile):
            inspect_gguf(path)


def test_real_starter_model(starter_gguf: Path) -> None:
    info = inspect_gguf(starter_gguf)
    assert info.architecture == "gemma3"
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (
        18, 640, 4, 1)
    assert info.context_length == 32768 and info.sliding_window == 512
    assert info.quantization == "Q4_K_M"
    assert 268_000_000 < info.parameter_count < 268_200_000
    assert len(info.tensor_bytes) == 236
    assert info.chat_template is None


SEED = valid_handmade()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """Splices, truncations and byte flips of a valid seed, plus raw noise."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=65536))
    data = bytearray(SEED)
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "cut", "int"]))
        if op == "flip" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(max_size=64))
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos + 8] = struct.pack("<Q", draw(st.sampled_from(
                [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, len(data)])))
    return bytes(data[:65536])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_only_invalid_model_file_escapes(data: bytes) -> None:
    try:
        parse(data)
    except InvalidModelFile:
        pass


def token_array(words: list[bytes], declared: int | None = None) -> bytes:
    body = b"".join(struct.pack("<Q", len(w)) + w for w in words)
    header = struct.pack("<IQ", STRING, len(words) if declared is None else declared)
    return s("tokenizer.ggml.tokens") + struct.pack("<I", ARRAY) + header + body


def test_a_large_vocabulary_is_read_in_blocks() -> None:
    # 300k tokens span several of the reader's 1 MiB blocks, with strings across the seams.
    words = [b"tok%06d" % i + b"x" * (i % 7) for i in range(300_000)]
    after = kv_u32("general.alignment", 32)
    info = parse(build([token_array(words), after], []))
    assert info.metadata["general.alignment"] == 32  # the key after the array parsed in place


def test_a_token_array_that_runs_past_the_end_is_rejected() -> None:
    words = [b"a" * 10] * 1000
    assert "truncated" in rejects(build([token_array(words, declared=2000)], []))
    huge = s("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2) + \
        struct.pack("<Q", 17 << 20) + b"x" * 64
    assert "too long" in rejects(build([huge], []))
