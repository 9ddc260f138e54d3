"""Test helper: a tiny random LFM2 GGUF (a hybrid: short-convolution layers between
attention layers), written with the `gguf` package.

No hybrid model small enough for the tests ships on PyPI, so the tests make one as
llama.cpp loads LFM2 (src/models/lfm2.cpp): a layer whose `head_count_kv` is 0 is a
short convolution (`shortconv.in_proj`, `shortconv.conv` of `shortconv.l_cache` taps,
`shortconv.out_proj`), the rest attention with q and k norms; the output norm is named
`token_embd_norm`. Its memory is llama.cpp's hybrid one: KV cells for the attention
layers, and a recurrent state per sequence for the convolutions, which cannot be cut
back to an earlier position. The vocabulary is the chat starter's (SmolLM2's BPE with
ChatML tokens), so text tokenizes as it would for a real model. Its text means nothing;
the path is real.

    python -m tests.hybrid_model CHAT_GGUF OUT.gguf [--size tiny|bench]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import copy_tokenizer

ARCH = "lfm2"
L_CACHE = 3
Q8 = gguf.GGMLQuantizationType.Q8_0


@dataclass(frozen=True)
class Shape:
    layers: tuple[int, ...]  # head_count_kv per layer; 0 is a short convolution
    n_embd: int
    n_head: int
    n_ff: int


# `tiny`: conv, attention, conv, conv, attention, conv, the shape of LFM2's layer
# pattern; `bench`: a wider one of ten layers for benchmarks/hybrid.py (LFM2's own are
# not on PyPI).
SHAPES = {"tiny": Shape((0, 2, 0, 0, 2, 0), 64, 4, 128),
          "bench": Shape((0, 0, 4, 0, 0, 4, 0, 0, 4, 0), 512, 8, 1536)}


def write_hybrid(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0,
                 shape: Shape = SHAPES["tiny"]) -> Path:
    """A loadable LFM2 with seeded random weights and `tokenizer`'s vocabulary. `sure`
    scales the output norm: a model sure of its next token loops, which gives the
    n-gram index text to draft from."""
    reader = gguf.GGUFReader(str(tokenizer))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), ARCH)
    copy_tokenizer(reader, w)
    w.add_name("corral test hybrid")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(4096)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(len(shape.layers))
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(list(shape.layers))
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_shortconv_l_cache(L_CACHE)

    def rand(*dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return rng.normal(0.0, std, dims).astype(np.float32)

    def add(name: str, data: np.ndarray) -> None:
        """Matrices in Q8_0, as the starters are quantized: with batch-invariant kernels
        (CORRAL_DETERMINISTIC) a row's logits are then the same in any batch, which
        ggml's F16 matmuls do not promise (a verifying batch's rows differ from one
        token's in the third digit of a logprob)."""
        if data.ndim > 1:
            w.add_tensor(name, gguf.quants.quantize(data, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, data)

    def ones(n: int, scale: float = 1.0) -> np.ndarray:
        return (scale * (1.0 + rng.normal(0.0, 0.05, n))).astype(np.float32)

    e, ff, hd = shape.n_embd, shape.n_ff, shape.n_embd // shape.n_head
    add("token_embd.weight", rand(n_vocab, e, std=0.5))
    add("token_embd_norm.weight", ones(e, sure))
    for i, n_kv in enumerate(shape.layers):
        tensors = [("attn_norm", ones(e)), ("ffn_norm", ones(e)),
                   ("ffn_gate", rand(ff, e)), ("ffn_up", rand(ff, e)),
                   ("ffn_down", rand(e, ff))]
        if n_kv:
            kv = n_kv * hd
            tensors += [("attn_q", rand(e, e)), ("attn_k", rand(kv, e)),
                        ("attn_v", rand(kv, e)), ("attn_output", rand(e, e)),
                        ("attn_q_norm", ones(hd)), ("attn_k_norm", ones(hd))]
        else:
            tensors += [("shortconv.in_proj", rand(3 * e, e, std=0.2)),
                        ("shortconv.conv", rand(e, L_CACHE, std=0.5)),
                        ("shortconv.out_proj", rand(e, e, std=0.2))]
        for name, data in tensors:
            if name == "shortconv.conv":  # F32: ggml's ssm_conv reads its kernel as floats
                w.add_tensor(f"blk.{i}.{name}.weight", data)
            else:
                add(f"blk.{i}.{name}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    write_hybrid(args.tokenizer, args.out, shape=SHAPES[args.size])
    print(args.out)


if __name__ == "__main__":
    main()
