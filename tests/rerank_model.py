"""Test helper: a tiny random Qwen3-Reranker GGUF, written with the `gguf` package.

No reranker ships on PyPI, so the tests make one the way llama.cpp's convert_hf_to_gguf
writes Qwen3-Reranker (conversion/qwen.py): a Qwen3 with `pooling_type` rank,
`classifier.output_labels` ["yes", "no"], a `cls.output` head of two rows, and a
`rerank` chat template with `{query}` and `{document}`. llama.cpp pools the last
token, projects it through `cls.output` and softmaxes the two: the score is P("yes").
The vocabulary is the chat starter's (SmolLM2's BPE with ChatML tokens), so text
tokenizes as it would for a real model. Its scores mean nothing; the path is real.

    python -m tests.rerank_model CHAT_GGUF OUT.gguf [--size tiny|bench]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import copy_tokenizer

ARCH = "qwen3"
# As convert_hf_to_gguf writes Qwen3-Reranker's (conversion/qwen.py).
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int = 2048


# `bench` is a wider one of the same kind for benchmarks/rerank.py (a real-size
# reranker is not available offline).
SHAPES = {"tiny": Shape(64, 2, 4, 2, 16, 128), "bench": Shape(512, 8, 8, 4, 64, 1536)}


def write_reranker(tokenizer: Path, dst: Path, shape: Shape = SHAPES["tiny"],
                   seed: int = 0, template: bool = True) -> Path:
    """A loadable Qwen3 reranker with seeded random weights and `tokenizer`'s vocabulary;
    `template=False` leaves out the rerank template (llama-server then builds
    BOS query EOS SEP doc EOS from the vocabulary's flags)."""
    reader = gguf.GGUFReader(str(tokenizer))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), ARCH)
    copy_tokenizer(reader, w)
    w.add_name("corral test reranker")
    w.add_file_type(1)  # MOSTLY_F16
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    if template:
        w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])

    def rand(*dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return rng.normal(0.0, std, dims).astype(np.float16 if len(dims) > 1 else np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.05, n)).astype(np.float32)

    e, q, kv, hd = shape.n_embd, shape.n_head * shape.head_dim, \
        shape.n_head_kv * shape.head_dim, shape.head_dim
    w.add_tensor("token_embd.weight", rand(n_vocab, e, std=0.5))
    w.add_tensor("output_norm.weight", ones(e))
    w.add_tensor("cls.output.weight", rand(2, e, std=0.05))  # rows: "yes", "no"
    for i in range(shape.n_layer):
        for name, data in (("attn_norm", ones(e)), ("attn_q", rand(q, e)),
                           ("attn_k", rand(kv, e)), ("attn_v", rand(kv, e)),
                           ("attn_output", rand(e, q)), ("attn_q_norm", ones(hd)),
                           ("attn_k_norm", ones(hd)), ("ffn_norm", ones(e)),
                           ("ffn_gate", rand(shape.n_ff, e)), ("ffn_up", rand(shape.n_ff, e)),
                           ("ffn_down", rand(e, shape.n_ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", data)
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
    write_reranker(args.tokenizer, args.out, SHAPES[args.size])
    print(args.out)


if __name__ == "__main__":
    main()
