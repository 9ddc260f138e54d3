"""The GPU check's model, made where it runs: nothing large travels to the lent machine.

    python benchmarks/gpu_model.py tokenizer CHAT_GGUF OUT.gguf
        here: a tokenizer-only GGUF (vocabulary, merges, special ids, chat template; no
        tensors, a few MB) cut from the chat starter.
    python benchmarks/gpu_model.py model TOKENIZER.gguf OUT.gguf [--size 1b|tiny] [--seed N]
        there: a llama-architecture GGUF in F16 with seeded random weights around that
        tokenizer. `1b` is shaped like Llama 3.2 1B (2048 wide, 16 layers, GQA 32/8, 8192
        FFN, tied output): big enough that the GPU does real work. `tiny` is for the CPU
        rehearsal. Q4_K_M is then made from it by Corral's own create (llama_model_quantize).

Random weights make greedy text that means nothing, but it is deterministic, and the
kernels, memory and speeds are those of a real model of that shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

F16_FILE_TYPE = 1
STD = 0.02  # the usual initialisation scale: activations stay finite through the layers


@dataclass(frozen=True)
class Dims:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int = 4096


SIZES = {"1b": Dims(2048, 16, 32, 8, 8192), "tiny": Dims(256, 2, 4, 2, 512)}


def field_value(field: gguf.ReaderField) -> tuple[object, gguf.GGUFValueType,
                                                  gguf.GGUFValueType | None]:
    """A metadata field as GGUFWriter.add_key_value takes it: value, type, item type."""
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[1]
        if sub == gguf.GGUFValueType.STRING:
            items: list[object] = [bytes(field.parts[i]).decode("utf-8", "replace")
                                   for i in field.data]
        else:
            items = [field.parts[i].tolist()[0] for i in field.data]
        return items, vtype, sub
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace"), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value, vtype, sub = field_value(field)
            writer.add_key_value(name, value, vtype, sub_type=sub)


def cut_tokenizer(src: Path, dst: Path) -> int:
    """Copy every `tokenizer.*` field of `src` into a GGUF with no tensors; its size."""
    writer = gguf.GGUFWriter(str(dst), "llama")
    copy_tokenizer(gguf.GGUFReader(str(src)), writer)
    writer.add_name("corral gpu-check tokenizer")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst.stat().st_size


def write_model(tokenizer: Path, dst: Path, dims: Dims, seed: int = 1,
                sure: float = 1.0) -> int:
    """A llama GGUF in F16 with seeded random weights; the number of parameters. `sure`
    scales the output norm, and so the logits: at 100 the model gives nearly all of its
    probability to one token (the tests' draft model, which must be sure to propose)."""
    reader = gguf.GGUFReader(str(tokenizer))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(dst), "llama")
    copy_tokenizer(reader, writer)
    head = dims.n_embd // dims.n_head
    writer.add_name(f"corral gpu-check random llama ({dims.n_embd}x{dims.n_layer})")
    writer.add_context_length(dims.n_ctx)
    writer.add_embedding_length(dims.n_embd)
    writer.add_block_count(dims.n_layer)
    writer.add_feed_forward_length(dims.n_ff)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head_kv)
    writer.add_rope_dimension_count(head)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(F16_FILE_TYPE)
    rng = np.random.default_rng(seed)
    count = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal count
        data = rng.standard_normal((rows, cols), dtype=np.float32)
        data *= STD
        writer.add_tensor(name, data.astype(np.float16))
        count += rows * cols

    def norm(name: str, scale: float = 1.0) -> None:
        nonlocal count
        writer.add_tensor(name, np.full(dims.n_embd, scale, dtype=np.float32))
        count += dims.n_embd

    matrix("token_embd.weight", n_vocab, dims.n_embd)  # tied: no output.weight
    norm("output_norm.weight", sure)
    for i in range(dims.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", dims.n_head * head, dims.n_embd)
        matrix(f"blk.{i}.attn_k.weight", dims.n_head_kv * head, dims.n_embd)
        matrix(f"blk.{i}.attn_v.weight", dims.n_head_kv * head, dims.n_embd)
        matrix(f"blk.{i}.attn_output.weight", dims.n_embd, dims.n_head * head)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", dims.n_ff, dims.n_embd)
        matrix(f"blk.{i}.ffn_up.weight", dims.n_ff, dims.n_embd)
        matrix(f"blk.{i}.ffn_down.weight", dims.n_embd, dims.n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("tokenizer")
    tok.add_argument("src", type=Path)
    tok.add_argument("dst", type=Path)
    mod = sub.add_parser("model")
    mod.add_argument("tokenizer", type=Path)
    mod.add_argument("dst", type=Path)
    mod.add_argument("--size", choices=sorted(SIZES), default="1b")
    mod.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.what == "tokenizer":
        size = cut_tokenizer(args.src, args.dst)
        print(f"tokenizer GGUF: {size / 1e6:.1f} MB")
    else:
        n = write_model(args.tokenizer, args.dst, SIZES[args.size], args.seed)
        print(f"random llama: {n / 1e9:.2f}B parameters, {args.dst.stat().st_size / 1e9:.2f} GB "
              f"F16, written in {time.perf_counter() - started:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
