"""Test helper: a tiny random Qwen3.5 GGUF with one MTP (`nextn`) layer, written with
the `gguf` package.

Qwen3.5 is a hybrid: gated delta-net layers (a recurrent state per sequence) with a
full-attention layer every `full_attention_interval`, and its GGUFs carry a
multi-token-prediction block after the trunk (`nextn_predict_layers`), which llama.cpp
runs in a context of its own (LLAMA_CONTEXT_TYPE_MTP) to draft the next tokens from the
trunk's last hidden state. No such model small enough for the tests ships on PyPI, so the
tests make one as the pinned llama.cpp loads it (src/models/qwen35.cpp): the trunk's
blocks, then the MTP block, a full-attention block with `nextn.eh_proj` (the token's
embedding and the hidden state, normed and joined, projected to the model's width).
The vocabulary is the chat starter's (SmolLM2's BPE with ChatML tokens); the weights
mean nothing, the path is real.

    python -m tests.mtp_model CHAT_GGUF OUT.gguf [--part whole|model|head]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import copy_tokenizer

ARCH = "qwen35"
Q8 = gguf.GGMLQuantizationType.Q8_0
EMBD, HEADS, HEADS_KV, HEAD_DIM, FF = 64, 4, 2, 16, 128
TRUNK, INTERVAL = 4, 4  # layers 0-2 gated delta-net, 3 attention; 4 is the MTP block
CONV, STATE, GROUPS, V_HEADS = 4, 16, 2, 4  # ssm: conv taps, head size, k heads, v heads


def write_mtp(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0,
              trunk: bool = True, head: bool = True) -> Path:
    """A loadable Qwen3.5 with an MTP layer, seeded random weights and `tokenizer`'s
    vocabulary. `sure` scales the output norm, as in tests.hybrid_model. Without `head`,
    the model alone (as converted without its MTP layers); without `trunk`, the head
    alone, a sidecar (a DRAFT) for the model of the same seed."""
    reader = gguf.GGUFReader(str(tokenizer))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), ARCH)
    copy_tokenizer(reader, w)
    w.add_name("corral test mtp")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(4096)
    w.add_embedding_length(EMBD)
    w.add_block_count(TRUNK + head)
    if head:
        w.add_uint32(f"{ARCH}.nextn_predict_layers", 1)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_array(f"{ARCH}.rope.dimension_sections", [4, 2, 2, 0])
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{ARCH}.full_attention_interval", INTERVAL)
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_inner_size(STATE * V_HEADS)
    w.add_ssm_state_size(STATE)
    w.add_ssm_time_step_rank(V_HEADS)
    w.add_ssm_group_count(GROUPS)

    def rand(*dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return rng.normal(0.0, std, dims).astype(np.float32)

    def ones(n: int, scale: float = 1.0) -> np.ndarray:
        return (scale * (1.0 + rng.normal(0.0, 0.05, n))).astype(np.float32)

    def add(name: str, data: np.ndarray) -> None:
        """Matrices in Q8_0 (batch-invariant kernels; tests.hybrid_model says why)."""
        if data.ndim > 1 and data.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", rand(n_vocab, EMBD, std=0.5))
    add("output_norm.weight", ones(EMBD, sure))
    for i in range(TRUNK):  # drawn either way: the head's weights follow from the seed
        for name, data in _block(i, rand, ones):
            if trunk:
                add(f"blk.{i}.{name}", data)
    for name, data in _head(rand, ones) if head else []:
        add(f"blk.{TRUNK}.{name}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _block(i: int, rand, ones) -> list[tuple[str, np.ndarray]]:
    """Trunk block `i`'s tensors: gated delta-net, or full attention."""
    kv = HEADS_KV * HEAD_DIM
    out = [("attn_norm.weight", ones(EMBD)), ("post_attention_norm.weight", ones(EMBD)),
           ("ffn_gate.weight", rand(FF, EMBD)), ("ffn_up.weight", rand(FF, EMBD)),
           ("ffn_down.weight", rand(EMBD, FF))]
    if (i + 1) % INTERVAL:
        key, value = STATE * GROUPS, STATE * V_HEADS
        return out + [
            ("attn_qkv.weight", rand(2 * key + value, EMBD)),
            ("attn_gate.weight", rand(value, EMBD)),
            ("ssm_conv1d.weight", rand(2 * key + value, CONV, std=0.5)),
            ("ssm_dt.bias", rand(V_HEADS, std=0.5)),
            ("ssm_a", -np.abs(rand(V_HEADS, std=1.0))),
            ("ssm_beta.weight", rand(V_HEADS, EMBD)),
            ("ssm_alpha.weight", rand(V_HEADS, EMBD)),
            ("ssm_norm.weight", ones(STATE)),
            ("ssm_out.weight", rand(EMBD, value))]
    out += [("attn_q.weight", rand(2 * HEADS * HEAD_DIM, EMBD)),
            ("attn_k.weight", rand(kv, EMBD)), ("attn_v.weight", rand(kv, EMBD)),
            ("attn_output.weight", rand(EMBD, HEADS * HEAD_DIM)),
            ("attn_q_norm.weight", ones(HEAD_DIM)), ("attn_k_norm.weight", ones(HEAD_DIM))]
    return out


def _head(rand, ones) -> list[tuple[str, np.ndarray]]:
    """The MTP block, made to draft well: `eh_proj` passes the model's hidden state
    through (the token's half is nearly zero) and its attention and feed-forward add
    little, so the head's logits are about the model's at the position before. It then
    proposes the token the model just chose again: right wherever the model repeats
    itself (it loops, `sure`), wrong where it does not, so drafts are both kept and
    rejected."""
    def small(*dims: int) -> np.ndarray:
        return rand(*dims, std=0.002)

    kv = HEADS_KV * HEAD_DIM
    eh = np.concatenate([small(EMBD, EMBD), np.eye(EMBD, dtype=np.float32)], axis=1)
    return [("attn_norm.weight", ones(EMBD)), ("post_attention_norm.weight", ones(EMBD)),
            ("ffn_gate.weight", small(FF, EMBD)), ("ffn_up.weight", small(FF, EMBD)),
            ("ffn_down.weight", small(EMBD, FF)),
            ("attn_q.weight", small(2 * HEADS * HEAD_DIM, EMBD)),
            ("attn_k.weight", small(kv, EMBD)), ("attn_v.weight", small(kv, EMBD)),
            ("attn_output.weight", small(EMBD, HEADS * HEAD_DIM)),
            ("attn_q_norm.weight", ones(HEAD_DIM)), ("attn_k_norm.weight", ones(HEAD_DIM)),
            ("nextn.eh_proj.weight", eh),
            ("nextn.enorm.weight", ones(EMBD)), ("nextn.hnorm.weight", ones(EMBD))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--part", choices=("whole", "model", "head"), default="whole")
    args = parser.parse_args()
    write_mtp(args.tokenizer, args.out, trunk=args.part != "head",
              head=args.part != "model")
    print(args.out)


if __name__ == "__main__":
    main()
