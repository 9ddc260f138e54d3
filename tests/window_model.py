"""Test helper: a tiny random Gemma 3 GGUF whose attention layers but the last of every
six look back only WINDOW tokens (a sliding window), written with the `gguf` package.

The base starter is a Gemma 3 too, but its window is 512 tokens, so every test of a
window cache on it would prefill thousands; this one's is 16, and a prompt of a few
dozen tokens has long left it. Built as llama.cpp loads Gemma 3 (src/models/gemma3.cpp:
`attention.sliding_window`, every sixth layer global, q and k norms, norms after the
attention and the feed-forward). The vocabulary is the chat starter's, so text tokenizes
as it would for a real model. Its text means nothing; the path is real.

    python -m tests.window_model CHAT_GGUF OUT.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import copy_tokenizer

ARCH = "gemma3"
WINDOW = 16
LAYERS = 6  # five sliding-window layers, then a global one (Gemma 3's pattern)
Q8 = gguf.GGMLQuantizationType.Q8_0


def write_window(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0,
                 n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2) -> Path:
    """A loadable Gemma 3 with seeded random weights, a window of WINDOW tokens and
    `tokenizer`'s vocabulary. `sure` scales the output norm (a model sure of its next
    token loops, which gives the n-gram index text to draft from)."""
    reader = gguf.GGUFReader(str(tokenizer))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), ARCH)
    copy_tokenizer(reader, w)
    w.add_name("corral test window")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(2 * n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(n_embd // n_head)
    w.add_value_length(n_embd // n_head)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)

    def add(name: str, data: np.ndarray) -> None:
        """Matrices in Q8_0, as the starters are quantized: with batch-invariant kernels
        (CORRAL_DETERMINISTIC) a row's logits are then the same in any batch."""
        if data.ndim > 1:
            w.add_tensor(name, gguf.quants.quantize(data, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, data)

    def rand(*dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return rng.normal(0.0, std, dims).astype(np.float32)

    def norm(n: int, scale: float = 0.0) -> np.ndarray:  # Gemma's norms add one
        return (scale + rng.normal(0.0, 0.05, n)).astype(np.float32)

    e, hd = n_embd, n_embd // n_head
    add("token_embd.weight", rand(n_vocab, e, std=0.5))
    add("output_norm.weight", norm(e, sure))
    for i in range(LAYERS):
        for name, data in [("attn_norm", norm(e)), ("attn_q", rand(n_head * hd, e)),
                           ("attn_k", rand(n_head_kv * hd, e)),
                           ("attn_v", rand(n_head_kv * hd, e)),
                           ("attn_output", rand(e, n_head * hd)),
                           ("attn_q_norm", norm(hd)), ("attn_k_norm", norm(hd)),
                           ("post_attention_norm", norm(e)), ("ffn_norm", norm(e)),
                           ("ffn_gate", rand(2 * e, e)), ("ffn_up", rand(2 * e, e)),
                           ("ffn_down", rand(e, 2 * e)), ("post_ffw_norm", norm(e))]:
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
    args = parser.parse_args()
    print(write_window(args.tokenizer, args.out))


if __name__ == "__main__":
    main()
